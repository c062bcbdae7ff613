"""Weight sync on a GPU machine: bandwidth and decode stall per transport, the built-in engine.

A real `stream-rl serve --device cuda` process decodes under load (concurrent completions) while
this process, the trainer, pushes random versions of the same model with each transport it can
run: `cuda_ipc` and `gloo` (the two colocated paths: trainer and server on one GPU) and, with two
GPUs, `nccl` (the server on GPU 1). Per push: the trainer's wall time (-> GB/s of the model's
bytes), the server's receive_ms and stall_ms (how long decoding paused for the swap), and decode
tokens/s during the pushes against before them. Both sides run in one invocation; repeats are
the pushes.

    python bench/gpu_weight_sync.py [--hidden 1024 --layers 24] [--pushes 5] [--out FILE]

Writes JSON (default bench/results/gpu_weight_sync.json) and prints a table. GPU only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the test builders (tests/fakes)

from fakes.server_thread import random_weights  # noqa: E402

from stream_rl.train.step import load_model  # noqa: E402
from stream_rl.weights import ServerEndpoint  # noqa: E402
from stream_rl.weights.sender_choice import make_builtin_sender  # noqa: E402

RESULTS = REPO / "bench" / "results" / "gpu_weight_sync.json"
TOKEN = "bench"
GENERATED = "stream_rl_inference_generated_tokens_total"


def write_model(out: Path, hidden: int, layers: int) -> Path:
    """A random Qwen2 of `layers` x `hidden` (untied head) with the project's byte tokenizer."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from stream_rl.inference.model_maker import build_tokenizer

    tok = build_tokenizer()
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def generated(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(GENERATED):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


class Load:
    """`streams` threads of completions back to back against the server."""

    def __init__(self, url: str, streams: int = 16) -> None:
        self.url, self._stop = url, threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(streams)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        body = {"prompt": [5 + i, 6, 7], "max_tokens": 256, "ignore_eos": True, "temperature": 1.0}
        with httpx.Client(timeout=120) as http:
            while not self._stop.is_set():
                http.post(f"{self.url}/v1/completions", json=body)

    def stop(self) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(timeout=120)


def rate(url: str, seconds: float) -> float:
    n0, t0 = generated(url), time.monotonic()
    time.sleep(seconds)
    return (generated(url) - n0) / (time.monotonic() - t0)


def start_server(model: Path, gpu: int, tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    port_file = tmp / f"port-{gpu}"
    env = dict(
        os.environ,
        CUDA_VISIBLE_DEVICES=str(gpu),
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    cmd = [
        sys.executable, "-m", "stream_rl.cli", "serve", "--model", str(model), "--dtype", "bfloat16",
        "--device", "cuda", "--port", "0", "--port-file", str(port_file), "--admin-token", TOKEN,
        "--max-batch", "32", "--weights-timeout", "120",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    deadline = time.monotonic() + 180
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the server did not start")
        time.sleep(0.2)
    url = f"http://127.0.0.1:{port_file.read_text().strip()}"
    while httpx.get(f"{url}/health", timeout=10).status_code != 200:
        time.sleep(0.2)
    return proc, url


def measure(transport: str, url: str, named: list[Any], pushes: int, bucket_mb: int) -> dict[str, Any]:
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    sender = make_builtin_sender(
        [ServerEndpoint(url, TOKEN)],
        transport=transport,
        trainer_device="cuda",
        master_addr="127.0.0.1",
        master_port=0,
        timeout_s=120,
    )
    try:
        assert sender.connect() == {}, "did not join"
        sender.push(1000, named, bucket_mb << 20)  # warm-up (allocations, handles, communicators)
        idle = rate(url, 2.0)
        n0, t0 = generated(url), time.monotonic()
        rows = []
        for k in range(pushes):
            start = time.perf_counter()
            report = sender.push(1001 + k, named, bucket_mb << 20)
            wall = (time.perf_counter() - start) * 1000
            assert not report.failed, report.failed
            per = report.per_server[url]
            rows.append({"push_ms": wall, "receive_ms": per["receive_ms"], "stall_ms": per["stall_ms"]})
        during = (generated(url) - n0) / (time.monotonic() - t0)
    finally:
        sender.close()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return {
        "transport": transport,
        "model_bytes": nbytes,
        "pushes": rows,
        "push_ms_median": round(med["push_ms"], 2),
        "receive_ms_median": round(med["receive_ms"], 2),
        "stall_ms_median": round(med["stall_ms"], 3),
        "stall_ms_max": round(max(r["stall_ms"] for r in rows), 3),
        "gb_per_s": round(nbytes / (med["push_ms"] / 1000) / 1e9, 2),
        "decode_tokens_per_s_idle": round(idle),
        "decode_tokens_per_s_during_pushes": round(during),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    results: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = write_model(tmp / "model", args.hidden, args.layers)
        trainer_model: Any = load_model(model, "bfloat16", "cuda")
        named = [(n, t.to("cuda")) for n, t in random_weights(trainer_model, 1)]
        plan = [("cuda_ipc", 0), ("gloo", 0)]
        if torch.cuda.device_count() >= 2:
            plan.append(("nccl", 1))
        else:
            skipped["nccl"] = "one GPU: NCCL refuses two ranks on one GPU (needs the server on a second GPU)"
        servers: dict[int, str] = {}
        try:
            for transport, gpu in plan:
                if gpu not in servers:
                    proc, servers[gpu] = start_server(model, gpu, tmp)
                    procs.append(proc)
                load = Load(servers[gpu])
                try:
                    time.sleep(2.0)
                    results.append(measure(transport, servers[gpu], named, args.pushes, args.bucket_mb))
                finally:
                    load.stop()
        finally:
            for proc in procs:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
    params = sum(t.numel() for _, t in named)
    print(f"weight sync on {torch.cuda.get_device_name(0)}: {params / 1e6:.0f}M params, bf16 + fp32 head")
    print(
        "| transport | push ms (median) | GB/s | server receive ms | stall ms median / max | decode tok/s idle -> during |"
    )
    print("|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['transport']} | {r['push_ms_median']} | {r['gb_per_s']} | {r['receive_ms_median']} "
            f"| {r['stall_ms_median']} / {r['stall_ms_max']} | {r['decode_tokens_per_s_idle']} -> "
            f"{r['decode_tokens_per_s_during_pushes']} |"
        )
    for name, why in skipped.items():
        print(f"{name}: not measured ({why})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"params": params, "results": results, "skipped": skipped}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
