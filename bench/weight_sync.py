"""Weight-sync transfer benchmark: bucketed broadcast vs one collective per parameter vs one
single broadcast of the same bytes, gloo between two processes on loopback.

Models are float32 tensors shaped like a Qwen2-style transformer (embeddings, q/k/v/o with
biases, gate/up/down, norms, untied lm_head) of ~1M, ~10M and ~100M parameters. Per size:
- `single`: one broadcast of all the bytes, buffers preallocated (the bandwidth ceiling);
- `per-param-sync`: one broadcast per parameter, each awaited before the next, received
  straight into the destination (the naive loop, as PipelineRL's per-parameter broadcast);
- `per-param`: one broadcast per parameter through the real sender/receiver (two in flight);
- `bucket-<N>MiB`: the real path: `send_buckets` packs and broadcasts, `WeightReceiver.receive`
  unpacks into the destination tensors.
A trial's time runs from rank 0's start to the receiver holding every byte in its destination
(both read CLOCK_MONOTONIC). One warm-up, then repeats with the modes taking turns; the
table gives medians (GB/s and ratios from medians) and minima.

    .venv/bin/python bench/weight_sync.py [--sizes 1m,10m,100m] [--bucket-mb 1,4,16,64] [--repeats 9]

Prints a table and the goal checks; writes bench/results/weight_sync.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stream_rl.weights.broadcast import send_buckets
from stream_rl.weights.buckets import TensorMeta, plan_buckets, tensor_bytes
from stream_rl.weights.group import SyncGroup, host_store
from stream_rl.weights.receiver import WeightReceiver

# name: (hidden, layers, intermediate, vocab)
SIZES: dict[str, tuple[int, int, int, int]] = {
    "1m": (128, 4, 384, 1024),
    "10m": (256, 8, 768, 6144),
    "100m": (768, 12, 2048, 8192),
}
RESULTS = Path(__file__).parent / "results" / "weight_sync.json"
TIMEOUT_S = 300.0


def transformer_metas(hidden: int, layers: int, intermediate: int, vocab: int) -> list[TensorMeta]:
    def m(name: str, *shape: int) -> TensorMeta:
        return TensorMeta(name, "float32", shape)

    metas = [m("model.embed_tokens.weight", vocab, hidden)]
    for i in range(layers):
        p = f"model.layers.{i}."
        for proj in ("q", "k", "v"):
            metas += [
                m(f"{p}self_attn.{proj}_proj.weight", hidden, hidden),
                m(f"{p}self_attn.{proj}_proj.bias", hidden),
            ]
        metas += [
            m(f"{p}self_attn.o_proj.weight", hidden, hidden),
            m(f"{p}mlp.gate_proj.weight", intermediate, hidden),
            m(f"{p}mlp.up_proj.weight", intermediate, hidden),
            m(f"{p}mlp.down_proj.weight", hidden, intermediate),
            m(f"{p}input_layernorm.weight", hidden),
            m(f"{p}post_attention_layernorm.weight", hidden),
        ]
    return [*metas, m("model.norm.weight", hidden), m("lm_head.weight", vocab, hidden)]


def modes(bucket_mb: list[float]) -> list[tuple[str, int | None]]:
    """(mode name, bucket bytes or None for the raw modes)."""
    return [("single", None), ("per-param-sync", None), ("per-param", 1)] + [
        (f"bucket-{mb:g}MiB", int(mb * (1 << 20))) for mb in bucket_mb
    ]


def trials(args: argparse.Namespace) -> list[tuple[str, str, int | None, int]]:
    """The identical schedule both ranks walk: (size, mode, bucket bytes, repeat index; -1 = warm-up).

    Modes take turns within each repeat, so that a load change on the (shared) machine hits
    every mode alike rather than whichever happened to run then.
    """
    out = []
    for size in args.sizes:
        for rep in range(-1, args.repeats):
            out += [(size, mode, bucket_bytes, rep) for mode, bucket_bytes in modes(args.bucket_mb)]
    return out


def run_sender(args: argparse.Namespace) -> int:
    store = host_store("127.0.0.1", 0, 2, TIMEOUT_S)
    worker = subprocess.Popen([sys.executable, __file__, "--worker-port", str(store.port), *sys.argv[1:]])
    try:
        group = SyncGroup(
            store, rank=0, world_size=2, backend="gloo", timeout_s=TIMEOUT_S, local_addr="127.0.0.1"
        )
        rows = sender_trials(args, group, store)
    finally:
        worker.wait(timeout=TIMEOUT_S)
    report(args, rows)
    return worker.returncode or 0


def sender_trials(args: argparse.Namespace, group: SyncGroup, store: dist.TCPStore) -> list[dict[str, Any]]:
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    sources: dict[str, list[torch.Tensor]] = {}
    for n, (size, mode, bucket_bytes, rep) in enumerate(trials(args)):
        metas = transformer_metas(*SIZES[size])
        if size not in sources:
            sources = {size: [torch.randn(m.shape) for m in metas]}
            flat = torch.cat([tensor_bytes(t) for t in sources[size]])
        tensors = sources[size]
        store.wait([f"bench/ready{n}"], timedelta(seconds=TIMEOUT_S))
        start = time.perf_counter()
        deadline = time.monotonic() + TIMEOUT_S
        if mode == "single":
            group.broadcast(flat, TIMEOUT_S).wait()
        elif mode == "per-param-sync":
            for t in tensors:
                group.broadcast(tensor_bytes(t), TIMEOUT_S).wait()
        else:
            assert bucket_bytes is not None
            send_buckets(group, plan_buckets(metas, bucket_bytes), tensors, deadline=deadline)
        done = float(store.get(f"bench/done{n}"))
        if rep < 0:
            continue
        row = rows.setdefault(
            (size, mode),
            {
                "size": size,
                "params": sum(m.numel for m in metas),
                "tensors": len(metas),
                "bytes": sum(m.nbytes for m in metas),
                "mode": mode,
                "bucket_bytes": bucket_bytes,
                "buckets": len(plan_buckets(metas, bucket_bytes)) if bucket_bytes else None,
                "trials_ms": [],
            },
        )
        row["trials_ms"].append((done - start) * 1000.0)
    return list(rows.values())


def _lookup(dest: dict[str, torch.Tensor]) -> Callable[[TensorMeta], torch.Tensor]:
    return lambda meta: dest[meta.name]


def run_receiver(args: argparse.Namespace) -> int:
    store = dist.TCPStore("127.0.0.1", args.worker_port, 2, False, timeout=timedelta(seconds=TIMEOUT_S))
    receiver = WeightReceiver(
        master_addr="127.0.0.1",
        master_port=args.worker_port,
        rank=1,
        world_size=2,
        backend="gloo",
        timeout_s=TIMEOUT_S,
    )
    dest: dict[str, torch.Tensor] = {}
    current = ""
    for n, (size, mode, bucket_bytes, _rep) in enumerate(trials(args)):
        metas = transformer_metas(*SIZES[size])
        if size != current:
            current = size
            dest = {m.name: torch.zeros(m.shape) for m in metas}
            flat = torch.zeros(sum(m.nbytes for m in metas), dtype=torch.uint8)
        store.set(f"bench/ready{n}", "1")
        if mode == "single":
            receiver.group.broadcast(flat, TIMEOUT_S).wait()
        elif mode == "per-param-sync":
            for m in metas:
                receiver.group.broadcast(tensor_bytes(dest[m.name]), TIMEOUT_S).wait()
        else:
            assert bucket_bytes is not None
            receiver.receive(metas, bucket_bytes, _lookup(dest))
        store.set(f"bench/done{n}", repr(time.perf_counter()))
    receiver.close()
    return 0


def report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    for row in rows:
        row["median_ms"] = statistics.median(row["trials_ms"])
        row["min_ms"] = min(row["trials_ms"])
        row["gbps"] = row["bytes"] / row["median_ms"] / 1e6
    print(f"\ngloo broadcast, 2 processes on loopback, float32, torch {torch.__version__}, 1 thread each")
    header = (
        f"{'model':>6} {'params':>11} {'MB':>7} {'mode':<15} {'median ms':>10} {'min ms':>8} {'GB/s':>6}"
        f" {'x per-param-sync':>17} {'% of single':>12}"
    )
    print(header)
    print("-" * len(header))
    summary: dict[str, Any] = {}
    for size in args.sizes:
        group = {r["mode"]: r for r in rows if r["size"] == size}
        single, naive, piped = group["single"], group["per-param-sync"], group["per-param"]
        for r in group.values():
            print(
                f"{size:>6} {r['params']:>11,} {r['bytes'] / 1e6:>7.1f} {r['mode']:<15} {r['median_ms']:>10.2f}"
                f" {r['min_ms']:>8.2f}"
                f" {r['gbps']:>6.2f} {naive['median_ms'] / r['median_ms']:>16.2f}x {100 * r['gbps'] / single['gbps']:>11.0f}%"
            )
        buckets = [r for m, r in group.items() if m.startswith("bucket-")]
        summary[size] = {}
        for stat in ("median_ms", "min_ms"):
            best = min(buckets, key=lambda r: float(r[stat]))
            summary[size][stat.removesuffix("_ms")] = {
                "best_bucket_mode": best["mode"],
                "speedup_vs_per_param_sync": naive[stat] / best[stat],
                "speedup_vs_per_param_pipelined": piped[stat] / best[stat],
                "fraction_of_single_bandwidth": single[stat] / best[stat],
            }
    print("\nGoals: bucketed >= 2x faster than one collective per parameter; >= 80% of one single broadcast")
    print("(best bucket size per model; from medians, then from minima, the less load-sensitive figure)")
    for size, by_stat in summary.items():
        for stat, s in by_stat.items():
            print(
                f"{size:>6} {stat:<6}: {s['best_bucket_mode']:<14} {s['speedup_vs_per_param_sync']:5.2f}x vs per-param-sync,"
                f" {s['speedup_vs_per_param_pipelined']:5.2f}x vs per-param (pipelined),"
                f" {100 * s['fraction_of_single_bandwidth']:4.0f}% of single"
            )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine()}
    RESULTS.write_text(
        json.dumps({"meta": meta, "args": vars(args), "rows": rows, "summary": summary}, indent=2)
    )
    print(f"\nwrote {RESULTS}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sizes", default="1m,10m,100m", type=lambda s: s.split(","), help="of " + ",".join(SIZES)
    )
    parser.add_argument("--bucket-mb", default="1,4,16,64", type=lambda s: [float(x) for x in s.split(",")])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--worker-port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    unknown = set(args.sizes) - set(SIZES)
    if unknown:
        parser.error(f"unknown sizes {sorted(unknown)}")
    torch.set_num_threads(1)
    if args.worker_port is not None:
        return run_receiver(args)
    return run_sender(args)


if __name__ == "__main__":
    raise SystemExit(main())
