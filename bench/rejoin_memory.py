"""Memory of a server dropped and re-joined again and again, with glibc's default arenas and with
MALLOC_ARENA_MAX=2.

Each fault that makes the trainer drop an inference server (a pause past the update deadline, a
server answering 500 or hanging) ends in a re-join: a new gloo group on both sides, whose threads
allocate and free in glibc's per-thread arenas. This bench isolates that: a trainer-side
`WeightSender` in a child process of its own and one `stream-rl serve` (the tiny model), a push,
a drop and a re-join per cycle, both processes' RSS read every `--every` cycles (the server trims
its heap each minute itself, `stream_rl.common.heap`; the sender trims before each reading). The
variants run in turn in one invocation, `--repeats` times each:

    .venv/bin/python bench/rejoin_memory.py [--cycles 200] [--repeats 2]

Prints a table (MiB grown per 100 re-joins after the first `--warmup` cycles, fitted, for the
sender and the server) and writes bench/results/rejoin_memory.json, whose readings also hold the
server's threads and open files (a group never released keeps both). Run long enough to span
several of the server's minute trims (`--cycles 1000`: 3 minutes a variant); a shorter run measures
freed heap not yet handed back.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
VARIANTS = {"glibc default": None, "MALLOC_ARENA_MAX=2": "2"}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return 0.0


def threads_fds(pid: int) -> tuple[int, int]:
    """A process's threads and open file descriptors: a group never released keeps both."""
    threads = next(
        int(line.split()[1])
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if line.startswith("Threads")
    )
    return threads, len(os.listdir(f"/proc/{pid}/fd"))


def fit(points: list[tuple[float, float]]) -> float:
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0


def child(cycles: int, every: int, out: Path) -> None:
    """The trainer's side, in a process of its own (its environment is the variant's)."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(REPO / "tests"))
    from models import cached_model
    from weight_stall import start_server  # this folder's: the server as weight_stall.py starts it

    from stream_rl.weights import ServerEndpoint, WeightSender

    model = cached_model("tiny")
    server, url = start_server(model, Path(tempfile.mkdtemp(prefix="rejoin-")), "t")
    try:
        weights = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        named = [(n, p.detach().clone()) for n, p in weights.named_parameters()]
        trim = ctypes.CDLL(None).malloc_trim
        sender = WeightSender([ServerEndpoint(url, "t")], master_port=0, timeout_s=30)
        if sender.connect():
            raise SystemExit("the first join failed")
        readings = []
        for cycle in range(cycles + 1):
            for _name, tensor in named:
                tensor.add_(1e-3)
            report = sender.push(cycle + 1, named, 1 << 20)
            if report.failed:
                raise SystemExit(f"push failed: {report.failed}")
            if cycle % every == 0:
                trim(0)
                threads, fds = threads_fds(server.pid)
                readings.append(
                    {
                        "cycle": cycle,
                        "sender": rss_mib(os.getpid()),
                        "server": rss_mib(server.pid),
                        "server_threads": threads,
                        "server_fds": fds,
                    }
                )
            sender.drop(url)
            if failed := sender.connect():
                raise SystemExit(f"re-join failed: {failed}")
        sender.close()
        out.write_text(json.dumps(readings))
    finally:
        server.terminate()
        server.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=200)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=20, help="cycles left out of the fit")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--name", default="rejoin_memory")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.cycles, args.every, args.child)
        return 0
    runs = []
    for repeat in range(args.repeats):
        for variant, arena in VARIANTS.items():
            env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
            if arena:
                env["MALLOC_ARENA_MAX"] = arena
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [sys.executable, __file__, "--cycles", str(args.cycles), "--every", str(args.every)]
                start = time.monotonic()
                subprocess.run([*cmd, "--child", f.name], env=env, check=True, cwd=REPO)
                readings = json.loads(Path(f.name).read_text())
            after = [r for r in readings if r["cycle"] >= args.warmup]
            run = {
                "variant": variant,
                "repeat": repeat,
                "seconds": round(time.monotonic() - start, 1),
                "readings": readings,
            }
            for side in ("sender", "server"):
                run[f"{side}_mib_per_100"] = round(100 * fit([(r["cycle"], r[side]) for r in after]), 2)
                run[f"{side}_grown_mib"] = round(readings[-1][side] - readings[0][side], 1)
            runs.append(run)
            print(
                f"{variant:>20} #{repeat}: sender {run['sender_mib_per_100']:+6.2f} MiB/100 re-joins "
                f"(grown {run['sender_grown_mib']:+.1f}), server {run['server_mib_per_100']:+6.2f} "
                f"(grown {run['server_grown_mib']:+.1f}), {run['seconds']} s",
                flush=True,
            )
    print(f"\n{args.cycles} re-joins each, fitted after the first {args.warmup}; MiB per 100 re-joins")
    print("| variant | sender | server | server grown (MiB) |\n|---|---|---|---|")
    for variant in VARIANTS:
        mine = [r for r in runs if r["variant"] == variant]
        s = ", ".join(f"{r['sender_mib_per_100']:+.2f}" for r in mine)
        v = ", ".join(f"{r['server_mib_per_100']:+.2f}" for r in mine)
        g = ", ".join(f"{r['server_grown_mib']:+.1f}" for r in mine)
        print(f"| {variant} | {s} | {v} | {g} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{args.name}.json"
    out.write_text(json.dumps({"cycles": args.cycles, "warmup": args.warmup, "runs": runs}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
