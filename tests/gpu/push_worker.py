"""A trainer stand-in for the GPU tests: its own process (CUDA IPC cannot open a handle in the
process that made it; NCCL wants one process per GPU), pushing random weights to one server.

    python tests/gpu/push_worker.py --url U --token T --model DIR --dtype D --transport T \\
        --versions 1,2 [--seed S] [--die-mid-push] [--timeout 30]

Prints one JSON line per version: `{"version", "t_start", "t_end", "report"}` (wall-clock
`time.time()`, comparable with the server's in the same machine). Version v's weights are
`fakes.server_thread.random_weights(model, seed + v)`, so the test can rebuild them.
`--die-mid-push`: start the first version's update and exit abruptly halfway through it (gloo,
nccl: after half the buckets; cuda_ipc: right after sending the request), like a trainer killed
mid-broadcast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fakes.server_thread import random_weights  # noqa: E402

from stream_rl.train.step import load_model  # noqa: E402
from stream_rl.weights import ServerEndpoint  # noqa: E402
from stream_rl.weights.sender_choice import make_builtin_sender  # noqa: E402

BUCKET = 8 << 20


def die_mid_push(sender: object, transport: str, named: list[tuple[str, torch.Tensor]], version: int) -> None:
    from stream_rl.weights.broadcast import send_buckets
    from stream_rl.weights.buckets import TensorMeta, plan_buckets
    from stream_rl.weights.ipc import pack_shared, share

    metas = [TensorMeta.from_tensor(n, t) for n, t in named]
    plan = plan_buckets(metas, BUCKET)
    if transport == "cuda_ipc":
        link = next(iter(sender._links.values()))  # type: ignore[attr-defined]
        buffers = pack_shared(plan, [t for _, t in named])
        torch.cuda.synchronize()
        handles = [share(b) for b in buffers]
        threading.Thread(
            target=link.client.update,
            kwargs=dict(version=version, metas=metas, bucket_bytes=BUCKET, timeout_s=30, ipc_buckets=handles),
            daemon=True,
        ).start()
        time.sleep(0.05)  # the request is on its way: die with the buffers still shared
        os._exit(3)
    link = next(iter(sender._links.values()))  # type: ignore[attr-defined]
    threading.Thread(
        target=link.client.update,
        kwargs=dict(version=version, metas=metas, bucket_bytes=BUCKET, timeout_s=30),
        daemon=True,
    ).start()
    half = plan[: max(1, len(plan) // 2)]
    count = sum(len(b) for b in half)
    send_buckets(link.group, half, [t for _, t in named[:count]], deadline=time.monotonic() + 30)
    print(json.dumps({"died_after_buckets": len(half), "of": len(plan)}), flush=True)
    os._exit(3)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--token", default=None)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--transport", required=True)
    parser.add_argument("--versions", default="1")
    parser.add_argument("--seed", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--die-mid-push", action="store_true")
    parser.add_argument("--device", default="cuda", help="cpu: dry runs of the gloo cases")
    parser.add_argument("--delay-s", type=float, default=0.0, help="wait after joining, before pushing")
    args = parser.parse_args()
    model = load_model(args.model, args.dtype, args.device)
    sender = make_builtin_sender(
        [ServerEndpoint(args.url, args.token)],
        transport=args.transport,
        trainer_device=args.device,
        master_addr="127.0.0.1",
        master_port=0,
        timeout_s=args.timeout,
    )
    failures = sender.connect()
    if failures:
        print(json.dumps({"connect_failures": failures}), flush=True)
        return 2
    print(json.dumps({"connected": sender.live_servers}), flush=True)
    time.sleep(args.delay_s)
    for version in [int(v) for v in args.versions.split(",")]:
        named = [(n, t.to(args.device)) for n, t in random_weights(model, args.seed + version)]
        if args.die_mid_push:
            die_mid_push(sender, args.transport, named, version)
        t_start = time.time()
        report = sender.push(version, named, BUCKET)
        t_end = time.time()
        out = {"version": version, "t_start": t_start, "t_end": t_end, "report": report.__dict__}
        print(json.dumps(out), flush=True)
        if report.failed:
            return 1
    sender.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
