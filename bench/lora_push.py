"""LoRA pushes against full pushes, on the real inference server: bytes per version, receive time
(the server's, transfer + merge for LoRA), decode stall, and the trainer's cost of a version
(merging its adapters for the checksum), at the `small` and `large` presets.

Per preset it makes the preset's model (`stream_rl.inference.model_maker`), starts `stream-rl serve`
on it (CPU, one torch thread), keeps it decoding with concurrent chat completions, builds the
torch trainer with `trainer.lora` (rank 8, alpha 16, q/k/v/o projections) and gives its B
matrices random values (a trained adapter; B = 0 would merge to the base), then pushes
`--updates` versions three ways, each over its own weight-sync group:

- `lora`: the adapters (`POST /weights/update_lora`; the server merges W0 + (alpha/r) B A);
- `delta`: the merged weights through `trainer.push_delta_threshold: 0` (only the tensors that
  changed since the server's version: the targeted weights, merged, in full);
- `full`: every merged weight (what a trainer without LoRA pushes).

The versions alternate between two adapter sets, so each push changes every targeted weight. The
first push of each way is not counted (the delta sender's first push is full, the server's first
LoRA update verifies its base). That the served weights are the trainer's bit for bit is the
integration tests' job (tests/integration/test_lora_push.py); here every push must succeed.

    .venv/bin/python bench/lora_push.py [--presets small,large] [--updates 5] [--rank 8]

Prints a table and writes bench/results/lora_push.json (the run in docs/lora.md: docs/perf/lora_push.json).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from weight_stall import DecodeLoad, start_server  # noqa: E402

from stream_rl.config import RunConfig  # noqa: E402
from stream_rl.weights import ServerEndpoint, WeightSender  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "lora_push.json"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def adapter_sets(trainer: Any, seed: int) -> list[dict[str, torch.Tensor]]:
    """Two sets of B matrices (std 0.02), made before the clock starts."""
    generator = torch.Generator().manual_seed(seed)
    return [
        {
            name: 0.02 * torch.randn(tuple(layer.lora_B["default"].weight.shape), generator=generator)
            for name, layer in trainer.layers.items()
        }
        for _ in range(2)
    ]


def set_adapters(trainer: Any, values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, layer in trainer.layers.items():
            layer.lora_B["default"].weight.copy_(values[name])


def measure(
    preset: str, model_dir: Path, url: str, token: str, args: argparse.Namespace
) -> list[dict[str, Any]]:
    from stream_rl.train.backends import build_trainer

    cfg = RunConfig.model_validate(
        {
            "model": {"path": str(model_dir)},
            "trainer": {"lora": {"rank": args.rank, "alpha": 2.0 * args.rank, "target_modules": TARGETS}},
        }
    )
    trainer: Any = build_trainer(cfg)
    sets = adapter_sets(trainer, seed=1)
    bucket = int(args.bucket_mb * (1 << 20))
    rows = []
    with DecodeLoad(url, args.streams, args.max_tokens) as load:
        load.rate(args.warmup_s)
        version = 0
        for way in ("lora", "delta", "full"):
            sender = WeightSender(
                [ServerEndpoint(url, token)],
                master_port=0,
                timeout_s=300,
                delta_threshold=0.0 if way == "delta" else None,
            )
            try:
                sender.connect()
                timings: list[dict[str, float]] = []
                merge_ms: list[float] = []
                for i in range(args.updates + 1):
                    version += 1
                    set_adapters(trainer, sets[version % 2])
                    started = time.perf_counter()
                    with trainer.full_weights() as named:
                        merge_ms.append((time.perf_counter() - started) * 1000)
                        payload = named if way == "lora" else list(named)
                        report = sender.push(version, payload, bucket)
                    if report.failed:
                        raise SystemExit(f"{preset} {way} version {version} failed: {report.failed}")
                    if i > 0:
                        timings.append(report.per_server[url])
                    time.sleep(args.gap_s)
            finally:
                sender.close()
            with trainer.full_weights() as named:
                full_bytes = sum(p.numel() * p.element_size() for _, p in named)
                params = sum(p.numel() for _, p in named)
            rows.append(
                {
                    "preset": preset,
                    "way": way,
                    "params": params,
                    "adapter_params": trainer.trainable_parameters(),
                    "full_bytes": full_bytes,
                    "bytes": statistics.median(t["bytes"] for t in timings),
                    "receive_ms": statistics.median(t["receive_ms"] for t in timings),
                    "broadcast_ms": statistics.median(t["broadcast_ms"] for t in timings),
                    "total_ms": statistics.median(t["total_ms"] for t in timings),
                    "stall_ms": statistics.median(t["stall_ms"] for t in timings),
                    "stall_ms_max": max(t["stall_ms"] for t in timings),
                    "trainer_merge_ms": statistics.median(merge_ms[1:]),
                    "request_errors": load.errors,
                    "updates": timings,
                }
            )
    return rows


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"\nLoRA (rank {args.rank}, q/k/v/o) vs full pushes, CPU, gloo, one server decoding "
        f"{args.streams} streams, bucket {args.bucket_mb:g} MiB, median of {args.updates} versions"
    )
    header = (
        f"{'preset':>6} {'params':>12} {'way':>6} {'MB/push':>9} {'x full':>7} {'receive ms':>11}"
        f" {'total ms':>9} {'stall ms (med/max)':>19} {'trainer merge ms':>17}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['preset']:>6} {r['params']:>12,} {r['way']:>6} {r['bytes'] / 1e6:>9.3f}"
            f" {r['bytes'] / r['full_bytes']:>7.4f} {r['receive_ms']:>11.1f} {r['total_ms']:>9.1f}"
            f" {r['stall_ms']:>9.2f} / {r['stall_ms_max']:<7.2f} {r['trainer_merge_ms']:>17.1f}"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {RESULTS}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default="small,large", type=lambda s: s.split(","))
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--bucket-mb", type=float, default=16.0, help="trainer.bucket_mb's default")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--gap-s", type=float, default=0.2)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from stream_rl.inference.model_maker import make_model

    token = "bench-" + os.urandom(8).hex()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="lora-push-") as tmp:
        for preset in args.presets:
            model_dir = make_model(Path(tmp) / preset, preset, seed=0)
            process, url = start_server(model_dir, Path(tmp), token)
            try:
                rows += measure(preset, model_dir, url, token, args)
            finally:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=60)
    report(rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
