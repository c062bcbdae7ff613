"""The built-in engine against vLLM's CPU build, on the same machine, model and requests, in one
invocation (the two servers run side by side; each measurement alternates A B A B):

1. tokens/s on the demo's workload (16 chat groups of `n = 8` two-digit additions at T = 1, up to
   8 tokens each, all in flight) and on mixed lengths (64 token-id prompts of 8-40 tokens, 8-128
   new tokens each, ignoring end of sequence, all in flight), through each engine's own client
   path (the built-in OpenAI routes; vLLM's render + `/inference/v1/generate`);
2. the stall per weight update while the engine decodes (the built-in server's `stall_ms`, which
   it measures itself; vLLM's `/pause` to `/resume`, measured by the trainer's sender), with the
   receive time beside it, at the `tiny` and `small` presets;
3. with `--demo`: the CPU demo (`configs/demo-cpu.yaml`) through the launcher on each engine, and
   the time from version 0 until the centred mean of 5 versions' trained reward reaches 0.8.

    make vllm && .venv/bin/python bench/engines.py [--presets tiny,small] [--repeats 3] [--demo]

Prints a table and writes bench/results/engines.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from stream_rl.common.ports import free_port
from stream_rl.config import SamplingConfig, load_config
from stream_rl.inference.clients import make_client
from stream_rl.inference.launching import launch_for
from stream_rl.inference.model_maker import make_model
from stream_rl.weights import ServerEndpoint, WeightSender
from stream_rl.weights.adapters.vllm import VLLMWeightSender

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "engines.json"
TOKEN = "bench-token"
ENGINES = ("builtin", "vllm")


class Server:
    def __init__(self, engine: str, model: Path, workdir: Path, threads: int) -> None:
        port = free_port()
        config = load_config(
            None,
            [
                f"model.path={model}",
                f"inference.engine={engine}",
                f"inference.base_port={port}",
                f"inference.torch_threads={threads}",
                "inference.max_batch=128",
                "inference.vllm.max_model_len=512",
            ],
        )
        launch = launch_for(config, 0)
        self.engine, self.url = engine, f"http://127.0.0.1:{port}"
        self.log = workdir / f"{engine}-{model.name}.log"
        env = {**os.environ, **launch.env, "STREAM_RL_ADMIN_TOKEN": TOKEN}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                launch.cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        started = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"{engine} server exited; see {self.log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - started > launch.startup_timeout_s:
                raise SystemExit(f"{engine} server not healthy; see {self.log}")
            time.sleep(0.5)
        self.startup_s = time.monotonic() - started

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


# -- throughput ---------------------------------------------------------------------------------


async def demo_workload(server: Server, rng: random.Random) -> int:
    sampling = SamplingConfig(temperature=1.0, max_tokens=8)
    async with make_client(server.engine, server.url, timeout_s=600) as client:
        groups = [
            client.complete_many(
                [{"role": "user", "content": f"{rng.randrange(100)}+{rng.randrange(100)}="}],
                sampling,
                n=8,
                seed=i,
            )
            for i in range(16)
        ]
        return sum(len(c.token_ids) for group in await asyncio.gather(*groups) for c in group)


async def mixed_workload(server: Server, rng: random.Random) -> int:
    """Token prompts, each with its own max_tokens, end of sequence ignored (raw bodies: our
    SamplingConfig has no ignore_eos, which only benchmarks want)."""
    work = [
        ([rng.randrange(8, 250) for _ in range(rng.randint(8, 40))], rng.randint(8, 128)) for _ in range(64)
    ]
    async with httpx.AsyncClient(base_url=server.url, timeout=600) as http:

        async def one(prompt: list[int], max_tokens: int) -> int:
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}
            if server.engine == "builtin":
                data = (await http.post("/v1/completions", json=body)).json()
                return len(data["choices"][0]["token_ids"])
            rendered = (await http.post("/v1/completions/render", json=body)).json()[0]
            rendered.pop("request_id")
            data = (await http.post("/inference/v1/generate", json=rendered)).json()
            return len(data["choices"][0]["token_ids"])

        return sum(await asyncio.gather(*(one(p, m) for p, m in work)))


def tokens_per_s(server: Server, workload: str, seed: int) -> float:
    rng = random.Random(seed)
    fn = demo_workload if workload == "demo" else mixed_workload
    start = time.perf_counter()
    tokens = asyncio.run(fn(server, rng))
    return tokens / (time.perf_counter() - start)


# -- stall per update ---------------------------------------------------------------------------


def stalls(server: Server, model: Path, updates: int) -> dict[str, list[float]]:
    from transformers import AutoModelForCausalLM

    weights = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    endpoint = ServerEndpoint(server.url, TOKEN)
    sender: Any = (
        WeightSender([endpoint], master_port=0, backend="gloo", timeout_s=60)
        if server.engine == "builtin"
        else VLLMWeightSender([endpoint], timeout_s=60, bucket_bytes=1 << 20)
    )
    out: dict[str, list[float]] = {"stall_ms": [], "receive_ms": []}
    stop = asyncio.Event()

    async def load() -> None:
        rng = random.Random(0)
        while not stop.is_set():
            await demo_workload(server, rng)

    async def main() -> None:
        decoding = asyncio.create_task(load())
        await asyncio.sleep(1.0)
        for version in range(1, updates + 1):
            with torch.no_grad():
                for p in weights.parameters():
                    p.add_(torch.randn_like(p) * 1e-3)
            report = await asyncio.to_thread(sender.push, version, list(weights.named_parameters()), 1 << 20)
            if report.failed:
                raise SystemExit(f"{server.engine}: push failed: {report.failed}")
            timing = report.per_server[server.url]
            out["stall_ms"].append(timing["stall_ms"])
            out["receive_ms"].append(timing.get("receive_ms", 0.0))
            await asyncio.sleep(0.3)
        stop.set()
        await decoding

    try:
        if sender.connect():
            raise SystemExit(f"{server.engine}: the sender could not join")
        asyncio.run(main())
    finally:
        sender.close()
    return out


# -- the demo through the launcher ----------------------------------------------------------------


def demo_run(engine: str, model: Path, repeat: int, runs_dir: Path, target: float) -> dict[str, Any]:
    sys.path.insert(0, str(REPO / "bench"))
    from run_probe import time_to_target, versions_of

    from stream_rl.observe.report import load_timeline

    run = f"engines-{engine}-r{repeat}-{int(time.time())}"
    broker = tempfile.mkdtemp(prefix=f"{run}-kafka-")
    overrides = [
        f"run={run}",
        f"runs_dir={runs_dir}",
        f"model.path={model}",
        f"inference.engine={engine}",
        f"kafka.port={free_port()}",
        f"kafka.data_dir={broker}",
        f"inference.base_port={free_port()}",
        "trainer.sync_master_port=0",
    ]
    cmd = [sys.executable, "-m", "stream_rl.cli", "run", "configs/demo-cpu.yaml"]
    for item in overrides:
        cmd += ["--set", item]
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.monotonic() - started
    if done.returncode != 0:
        return {"engine": engine, "rc": done.returncode, "error": done.stderr[-500:]}
    versions = versions_of(load_timeline(runs_dir / run / "timeline.jsonl"))
    t0 = versions[0]["created_ms"] / 1000
    curve = [(v["created_ms"] / 1000 - t0, float(v.get("reward_mean", 0.0))) for v in versions[1:]]
    summary = json.loads((runs_dir / run / "summary.json").read_text())
    return {
        "engine": engine,
        "repeat": repeat,
        "rc": 0,
        "launcher_wall_s": wall,
        "time_to_target_s": time_to_target(curve, target, 5),
        "training_window_s": curve[-1][0] if curve else None,
        "reward_first3": summary["reward"]["first3_mean"],
        "reward_last3": summary["reward"]["last3_mean"],
    }


# -- report -------------------------------------------------------------------------------------


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--updates", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per server")
    parser.add_argument(
        "--demo", action="store_true", help="also the demo through the launcher on each engine"
    )
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--out", type=Path, default=RESULTS, help="results file")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    results: dict[str, Any] = {
        "machine": {"cores": os.cpu_count(), "loadavg": os.getloadavg()},
        "presets": {},
    }
    for preset in filter(None, args.presets.split(",")):  # --presets '' with --demo: the demo only
        model = make_model(workdir / preset, preset, seed=0)
        servers = {engine: Server(engine, model, workdir, args.threads) for engine in ENGINES}
        try:
            row: dict[str, Any] = {"startup_s": {e: s.startup_s for e, s in servers.items()}}
            for workload in ("demo", "mixed"):
                samples: dict[str, list[float]] = {e: [] for e in ENGINES}
                ratios = []
                for repeat in range(args.repeats):
                    order = ENGINES if repeat % 2 == 0 else ENGINES[::-1]
                    got = {e: tokens_per_s(servers[e], workload, seed=repeat) for e in order}
                    for e in ENGINES:
                        samples[e].append(got[e])
                    ratios.append(got["vllm"] / got["builtin"])
                row[workload] = {"tokens_per_s": samples, "vllm_over_builtin": ratios}
                print(
                    f"{preset:6s} {workload:6s} tokens/s builtin {med(samples['builtin']):8.0f}  "
                    f"vllm {med(samples['vllm']):8.0f}  vllm/builtin {med(ratios):.2f} "
                    f"(min {min(ratios):.2f}, max {max(ratios):.2f})",
                    flush=True,
                )
            row["stall"] = {e: stalls(servers[e], model, args.updates) for e in ENGINES}
            for e in ENGINES:
                st = row["stall"][e]
                print(
                    f"{preset:6s} stall  {e:7s} median {med(st['stall_ms']):7.1f} ms, max {max(st['stall_ms']):7.1f} ms; "
                    f"receive median {med(st['receive_ms']):7.1f} ms",
                    flush=True,
                )
            results["presets"][preset] = row
        finally:
            for server in servers.values():
                server.stop()
    if args.demo:
        model = REPO / "models" / "tiny-arith"
        if not (model / "config.json").exists():
            raise SystemExit(
                "the demo needs models/tiny-arith: run `make demo` once (or make-model --warm-start)"
            )
        runs: list[dict[str, Any]] = []
        for repeat in range(args.repeats):
            for engine in ENGINES if repeat % 2 == 0 else ENGINES[::-1]:
                runs.append(demo_run(engine, model, repeat, REPO / "runs", args.target))
                print(json.dumps(runs[-1]), flush=True)
        results["demo"] = runs
        for e in ENGINES:
            times = [r["time_to_target_s"] for r in runs if r["engine"] == e and r.get("time_to_target_s")]
            print(
                f"demo   {e:7s} time to reward {args.target}: median {med(times):.1f} s over {len(times)} runs"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
