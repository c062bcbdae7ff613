"""Weight-update stall benchmark against the real inference server: per update, how long
decoding paused (`stall_ms`, the server's figure) versus how long receiving the same bytes
took (`receive_ms`), for models of ~1M, ~10M and ~100M parameters. Goal: stall <= 10 ms at
every size, i.e. the transfer hides behind decoding.

Per size it writes a random model (`stream_rl.inference.model_maker`), starts `stream-rl serve`
on it (CPU, one torch thread), keeps it decoding with concurrent chat completions, joins it
from a `WeightSender` and pushes new random weights `--updates` times. It also reports the
decode throughput (completion tokens/s) without updates (before and after) and while updating.

    .venv/bin/python bench/weight_stall.py [--sizes 1m,10m,100m] [--updates 8] [--bucket-mb 1]
    .venv/bin/python bench/weight_stall.py --server http://127.0.0.1:8100 [--token T]   # a running server

Needs the inference server (`stream_rl.inference`); prints a table and writes
bench/results/weight_stall.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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

from stream_rl.weights import ServerEndpoint, WeightSender
from stream_rl.weights.server_client import ServerClient

RESULTS = Path(__file__).parent / "results" / "weight_stall.json"
GENERATED_METRIC = "stream_rl_inference_generated_tokens_total"
# name: (hidden, layers, heads, kv heads, intermediate), for the inference model maker
SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "1m": (128, 4, 4, 2, 512),
    "10m": (256, 10, 4, 2, 1024),
    "100m": (768, 12, 12, 4, 3072),
}


class DecodeLoad:
    """`streams` threads sending chat completions back to back; counts completion tokens."""

    def __init__(self, url: str, streams: int, max_tokens: int) -> None:
        self.url = url
        self.max_tokens = max_tokens
        self.tokens = 0
        self.errors = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(streams)]

    def _run(self, index: int) -> None:
        body = {
            "model": "bench",
            "messages": [{"role": "user", "content": f"count to {index + 10}"}],
            "max_tokens": self.max_tokens,
            "temperature": 1.0,
        }
        with httpx.Client(timeout=300) as client:
            while not self._stop.is_set():
                try:
                    response = client.post(f"{self.url}/v1/chat/completions", json=body)
                    response.raise_for_status()
                    used = int(response.json()["usage"]["completion_tokens"])
                except (httpx.HTTPError, KeyError, ValueError):
                    with self._lock:
                        self.errors += 1
                    time.sleep(0.1)
                    continue
                with self._lock:
                    self.tokens += used

    def generated(self) -> float:
        """Tokens generated so far: the server's own counter (token-exact) when it exports one,
        else the completion tokens of finished requests (coarse with long requests)."""
        try:
            for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
                if line.startswith(GENERATED_METRIC + " "):
                    return float(line.split()[1])
        except httpx.HTTPError:
            pass
        return float(self.tokens)

    def rate(self, seconds: float) -> float:
        """Tokens generated per second over the next `seconds`."""
        start_tokens, start = self.generated(), time.perf_counter()
        time.sleep(seconds)
        return (self.generated() - start_tokens) / (time.perf_counter() - start)

    def __enter__(self) -> DecodeLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)
        if exc[0] is None and self.errors and not self.tokens:
            # A stall measured with nothing decoding says nothing (seen: a 404 for the model's name).
            raise SystemExit(f"every decode request to {self.url} failed ({self.errors}): no stall measured")


def make_model_dir(size: str, root: Path) -> Path:
    from stream_rl.inference import model_maker

    hidden, layers, heads, kv_heads, intermediate = SIZES[size]
    name = f"bench-{size}"
    model_maker.PRESETS[name] = model_maker.Preset(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=intermediate,
    )
    return model_maker.make_model(root / name, name, overwrite=True)


def start_server(model_dir: Path, root: Path, token: str) -> tuple[subprocess.Popen[bytes], str]:
    port_file = root / f"{model_dir.name}.port"
    port_file.unlink(missing_ok=True)
    command = [sys.executable, "-m", "stream_rl.cli", "serve", "--model", str(model_dir), "--port", "0"]
    command += ["--port-file", str(port_file), "--threads", "1", "--admin-token", token]
    command += ["--served-model-name", "bench"]  # the model DecodeLoad's requests name (else 404)
    process = subprocess.Popen(command)
    deadline = time.monotonic() + 300
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the inference server did not start ({' '.join(command)})")
        time.sleep(0.2)
    url = f"http://127.0.0.1:{int(port_file.read_text())}"
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"the inference server at {url} never became healthy")
        time.sleep(0.2)


def measure(url: str, token: str | None, label: str, args: argparse.Namespace) -> dict[str, Any]:
    with httpx.Client() as http:
        metas = ServerClient(ServerEndpoint(url, token), http).meta(60)
    generator = torch.Generator().manual_seed(0)
    # Two weight sets, made before the clock starts, alternate between updates.
    sets = [
        [(m.name, (0.02 * torch.randn(m.shape, generator=generator)).to(m.torch_dtype)) for m in metas]
        for _ in range(2)
    ]

    updates: list[dict[str, float]] = []
    with (
        DecodeLoad(url, args.streams, args.max_tokens) as load,
        WeightSender([ServerEndpoint(url, token)], master_port=0, timeout_s=120) as sender,
    ):
        sender.connect()
        load.rate(args.warmup_s)  # let decoding reach a steady state
        idle_rate = load.rate(args.window_s)
        tokens_before, start = load.generated(), time.perf_counter()
        for version in range(1, args.updates + 1):
            report = sender.push(version, sets[version % 2], int(args.bucket_mb * (1 << 20)))
            if report.failed:
                raise SystemExit(f"update {version} failed: {report.failed}")
            updates.append(report.per_server[url])
            time.sleep(args.gap_s)
        updating_rate = (load.generated() - tokens_before) / (time.perf_counter() - start)
        idle_rate = (idle_rate + load.rate(args.window_s)) / 2  # idle before and after the updates
        errors = load.errors
    stall = [u["stall_ms"] for u in updates]
    receive = [u["receive_ms"] for u in updates]
    return {
        "model": label,
        "params": sum(m.numel for m in metas),
        "bytes": sum(m.nbytes for m in metas),
        "tensors": len(metas),
        "updates": updates,
        "stall_ms_median": statistics.median(stall),
        "stall_ms_max": max(stall),
        "receive_ms_median": statistics.median(receive),
        "broadcast_ms_median": statistics.median(u["broadcast_ms"] for u in updates),
        "tokens_per_s_idle": idle_rate,
        "tokens_per_s_updating": updating_rate,
        "request_errors": errors,
    }


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"\nin-flight weight updates, CPU, gloo, bucket {args.bucket_mb:g} MiB, {args.updates} updates per size"
    )
    header = (
        f"{'model':>8} {'params':>12} {'MB':>7} {'stall ms (med/max)':>19} {'receive ms':>11}"
        f" {'stall/receive':>14} {'tok/s idle':>11} {'tok/s updating':>15}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['model']:>8} {r['params']:>12,} {r['bytes'] / 1e6:>7.1f}"
            f" {r['stall_ms_median']:>9.2f} / {r['stall_ms_max']:<7.2f} {r['receive_ms_median']:>11.1f}"
            f" {r['stall_ms_median'] / r['receive_ms_median']:>14.4f}"
            f" {r['tokens_per_s_idle']:>11.0f} {r['tokens_per_s_updating']:>15.0f}"
        )
    worst = max(r["stall_ms_max"] for r in rows)
    print(
        f"\nGoal: stall <= 10 ms at every size: worst stall {worst:.2f} ms -> {'met' if worst <= 10 else 'NOT met'}"
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {RESULTS}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sizes", default="1m,10m,100m", type=lambda s: s.split(","), help="of " + ",".join(SIZES)
    )
    parser.add_argument("--server", action="append", default=[], help="measure a running server instead")
    parser.add_argument("--token", default=None, help="admin token of --server")
    parser.add_argument("--updates", type=int, default=8)
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    parser.add_argument(
        "--streams", type=int, default=8, help="concurrent chat completions keeping decoding busy"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--gap-s", type=float, default=0.2, help="pause between updates")
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--window-s", type=float, default=3.0, help="idle throughput window")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    if args.server:
        for url in args.server:
            rows.append(measure(url, args.token, url.rsplit(":", 1)[-1], args))
    else:
        unknown = set(args.sizes) - set(SIZES)
        if unknown:
            parser.error(f"unknown sizes {sorted(unknown)}")
        token = "bench-" + os.urandom(8).hex()
        with tempfile.TemporaryDirectory(prefix="weight-stall-") as tmp:
            for size in args.sizes:
                model_dir = make_model_dir(size, Path(tmp))
                process, url = start_server(model_dir, Path(tmp), token)
                try:
                    rows.append(measure(url, token, size, args))
                finally:
                    process.send_signal(signal.SIGTERM)
                    process.wait(timeout=60)
    report(rows, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
