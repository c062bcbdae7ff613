"""Smaller full-model pushes (docs/weight-pushes.md): bytes per version, receive time and stall of
today's push against the bf16 wire and the delta push, at the model maker's presets.

Per preset it writes a model (`stream_rl.inference.model_maker`, float32), and per mode starts
`stream-rl serve` on it (CPU, one torch thread, the mode's `--dtype`) kept decoding by concurrent
chat completions, while a float32 "trainer" (the same model, AdamW at `--lr` on random tokens, the
same seed in every mode: the same trajectory) takes a step and pushes it, `--updates` times.
Modes (`--modes`):
- `fp32`: today's push: a float32 server, every tensor at every version;
- `bf16`: a bfloat16 server, `push_dtype="server"` (the trainer's float32 cast on the wire);
- `bf16-delta<T>` / `fp32-delta<T>`: the same with `delta_threshold=T` (only tensors that moved
  beyond T since the version the server holds).
Version 1 (the first push to a fresh server is always whole) is left out of the per-version
figures. The first mode is the baseline of the ratios.

    .venv/bin/python bench/push_size.py [--presets small,large] [--modes fp32,bf16,bf16-delta0]
        [--updates 6] [--repeats 2] [--lr 3e-4] [--bucket-mb 1] [--out docs/perf/push_size.json]

Prints a table; writes the JSON (every push's figures included).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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

sys.path.insert(0, str(Path(__file__).parent))
from weight_stall import DecodeLoad  # noqa: E402

from stream_rl.weights import ServerEndpoint, WeightSender  # noqa: E402

OUT = Path(__file__).parent.parent / "docs" / "perf" / "push_size.json"


def parse_mode(mode: str) -> tuple[str, float | None]:
    """`bf16-delta0.001` -> ("bfloat16", 0.001); `fp32` -> ("float32", None)."""
    dtype, _, delta = mode.partition("-delta")
    if dtype not in ("fp32", "bf16") or (_ and not delta):
        raise SystemExit(f"unknown mode {mode!r}: fp32 or bf16, optionally -delta<threshold>")
    return ("float32" if dtype == "fp32" else "bfloat16"), (float(delta) if _ else None)


def start_server(model_dir: Path, dtype: str, root: Path, token: str) -> tuple[subprocess.Popen[bytes], str]:
    port_file = root / f"{model_dir.name}-{dtype}.port"
    port_file.unlink(missing_ok=True)
    command = [sys.executable, "-m", "stream_rl.cli", "serve", "--model", str(model_dir), "--dtype", dtype]
    command += ["--port", "0", "--port-file", str(port_file), "--threads", "1", "--admin-token", token]
    command += ["--served-model-name", "bench"]  # the model DecodeLoad's requests name
    process = subprocess.Popen(command)
    deadline = time.monotonic() + 600
    while True:
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the inference server did not start ({' '.join(command)})")
        if port_file.exists() and port_file.read_text().strip():
            url = f"http://127.0.0.1:{int(port_file.read_text())}"
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return process, url
            except httpx.HTTPError:
                pass
        time.sleep(0.2)


def run_mode(model_dir: Path, mode: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    dtype, threshold = parse_mode(mode)
    token = "bench-" + os.urandom(8).hex()
    process, url = start_server(model_dir, dtype, root, token)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    vocab = model.config.vocab_size
    pushes: list[dict[str, float]] = []
    try:
        with (
            DecodeLoad(url, args.streams, args.max_tokens) as load,
            WeightSender(
                [ServerEndpoint(url, token)],
                master_port=0,
                timeout_s=300,
                push_dtype="server",
                delta_threshold=threshold,
            ) as sender,
        ):
            sender.connect()
            load.rate(args.warmup_s)
            for version in range(1, args.updates + 1):
                ids = torch.randint(vocab, (args.batch, args.seq))
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                named = [(n, p.detach()) for n, p in model.named_parameters()]
                report = sender.push(version, named, int(args.bucket_mb * (1 << 20)))
                if report.failed:
                    raise SystemExit(f"{mode}: version {version} failed: {report.failed}")
                pushes.append(report.per_server[url])
            errors = load.errors
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
    later = pushes[1:]
    full = pushes[0]["bytes"]
    return {
        "mode": mode,
        "server_dtype": dtype,
        "delta_threshold": threshold,
        "params": sum(p.numel() for p in model.parameters()),
        "tensors": len(list(model.parameters())),
        "full_push_bytes": full,
        "bytes_per_version": statistics.mean(p["bytes"] for p in later),
        "tensors_per_version": statistics.mean(p["tensors"] for p in later),
        "receive_ms_median": statistics.median(p["receive_ms"] for p in later),
        "stall_ms_median": statistics.median(p["stall_ms"] for p in later),
        "stall_ms_max": max(p["stall_ms"] for p in later),
        "broadcast_ms_median": statistics.median(p["broadcast_ms"] for p in later),
        "request_errors": errors,
        "pushes": pushes,
    }


def merged(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from a mode's repeats: means and medians over every push after each run's first."""
    later = [p for r in runs for p in r["pushes"][1:]]
    return {
        **{k: runs[0][k] for k in ("mode", "server_dtype", "delta_threshold", "params", "tensors")},
        "full_push_bytes": runs[0]["full_push_bytes"],
        "repeats": len(runs),
        "bytes_per_version": statistics.mean(p["bytes"] for p in later),
        "tensors_per_version": statistics.mean(p["tensors"] for p in later),
        "receive_ms_median": statistics.median(p["receive_ms"] for p in later),
        "receive_ms_per_repeat": [r["receive_ms_median"] for r in runs],
        "stall_ms_median": statistics.median(p["stall_ms"] for p in later),
        "stall_ms_max": max(p["stall_ms"] for p in later),
        "stall_ms_per_repeat": [r["stall_ms_median"] for r in runs],
        "broadcast_ms_median": statistics.median(p["broadcast_ms"] for p in later),
        "request_errors": sum(r["request_errors"] for r in runs),
        "pushes": [r["pushes"] for r in runs],
    }


def print_table(preset: str, rows: list[dict[str, Any]]) -> None:
    base = rows[0]
    print(
        f"\n{preset}: {base['params']:,} parameters, {base['tensors']} tensors; versions 2..{len(base['pushes'][0])}"
        f" of {base['repeats']} run(s) per mode, taking turns"
    )
    header = (
        f"{'mode':>16} {'MB/version':>11} {'x base':>7} {'tensors':>8} {'receive ms':>11} {'x base':>7}"
        f" {'stall ms med/max':>17} {'broadcast ms':>13}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['mode']:>16} {r['bytes_per_version'] / 1e6:>11.2f}"
            f" {r['bytes_per_version'] / base['bytes_per_version']:>7.3f} {r['tensors_per_version']:>8.1f}"
            f" {r['receive_ms_median']:>11.1f} {r['receive_ms_median'] / base['receive_ms_median']:>7.3f}"
            f" {r['stall_ms_median']:>8.2f}/{r['stall_ms_max']:<8.2f} {r['broadcast_ms_median']:>13.1f}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default="small,large", type=lambda s: s.split(","))
    parser.add_argument("--modes", default="fp32,bf16,bf16-delta0,fp32-delta0", type=lambda s: s.split(","))
    parser.add_argument("--updates", type=int, default=6, help="pushes per run (the first is left out)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per mode (a fresh server each)")
    parser.add_argument("--lr", type=float, default=3e-4, help="AdamW lr of the trainer (the demo's: 3e-4)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    parser.add_argument("--streams", type=int, default=4, help="chat completions keeping decoding busy")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    for mode in args.modes:
        parse_mode(mode)
    torch.set_num_threads(1)
    from stream_rl.inference.model_maker import PRESETS, make_model

    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="push-size-") as tmp:
        for preset in args.presets:
            if preset not in PRESETS:
                parser.error(f"unknown preset {preset!r}: one of {', '.join(PRESETS)}")
            model_dir = make_model(Path(tmp) / preset, preset, seed=0)
            runs = [
                run_mode(model_dir, mode, args, Path(tmp)) for _ in range(args.repeats) for mode in args.modes
            ]  # the modes take turns, so that a noisy stretch of the machine hits them alike
            results[preset] = [merged([r for r in runs if r["mode"] == mode]) for mode in args.modes]
            print_table(preset, results[preset])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__}
    args.out.write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **meta, "presets": results}, indent=2)
    )
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
