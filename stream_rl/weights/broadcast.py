"""Rank 0's bucket stream: pack each bucket and broadcast it, two in flight, within a deadline.

`send_buckets` is the sending half of `WeightReceiver.receive`: both walk the same
`plan_buckets` plan. A bucket of one contiguous tensor on the group's device is sent from the
tensor itself; the others are packed into one of two reusable buffers while the previous
bucket travels. Every collective carries the deadline, and `abort()` is consulted whenever the
sender waits, so a failure elsewhere (the server's HTTP answer) stops the stream early.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from stream_rl.errors import WeightSyncError
from stream_rl.weights.buckets import TensorMeta, bucket_nbytes, pack_bucket, tensor_bytes
from stream_rl.weights.group import SyncGroup

IN_FLIGHT = 2


def _never() -> str | None:
    return None


def send_buckets(
    group: SyncGroup,
    plan: Sequence[Sequence[TensorMeta]],
    sources: Sequence[torch.Tensor],
    *,
    deadline: float,
    abort: Callable[[], str | None] = _never,
    wake: threading.Event | None = None,
) -> None:
    """Broadcast `sources` (in plan order) from rank 0; returns once every bucket went through.

    `deadline` is a `time.monotonic()` instant; `abort` returns a reason to give up, checked
    while waiting; `wake` is an event that whoever can change `abort`'s answer sets.
    Raises `WeightSyncError` on a failed collective, an abort or the deadline.
    """
    wake = wake or threading.Event()
    device = group.device
    ring_bytes = max((bucket_nbytes(b) for b in plan if len(b) > 1), default=0)
    ring: list[torch.Tensor | None] = [None] * IN_FLIGHT
    in_flight: deque[dist.Work] = deque()
    offset = 0
    for index, bucket in enumerate(plan):
        tensors = sources[offset : offset + len(bucket)]
        offset += len(bucket)
        size = bucket_nbytes(bucket)
        if size == 0:  # only empty tensors: nothing travels (the receiver skips it too)
            continue
        if len(tensors) == 1 and tensors[0].device == device and tensors[0].is_contiguous():
            payload = tensor_bytes(tensors[0])
        else:
            slot = index % IN_FLIGHT  # free: its previous bucket completed two steps ago
            buffer = ring[slot]
            if buffer is None or buffer.numel() < size:
                buffer = torch.empty(max(ring_bytes, size), dtype=torch.uint8, device=device)
                ring[slot] = buffer
            payload = pack_bucket(tensors, out=buffer)
        work = group.broadcast(payload, deadline - time.monotonic())
        if group.backend == "gloo":
            work.get_future().add_done_callback(lambda _f: wake.set())
        in_flight.append(work)
        if len(in_flight) == IN_FLIGHT:
            await_work(in_flight.popleft(), group, deadline=deadline, abort=abort, wake=wake)
    while in_flight:
        await_work(in_flight.popleft(), group, deadline=deadline, abort=abort, wake=wake)


def await_work(
    work: dist.Work,
    group: SyncGroup,
    *,
    deadline: float,
    abort: Callable[[], str | None],
    wake: threading.Event,
) -> None:
    """Wait for one collective, giving up on `abort()` or at the deadline."""
    # Woken by the work's completion (gloo future callback) or by `abort`'s source; NCCL
    # futures complete before the GPU does, so NCCL work is polled instead.
    poll_s = 0.05 if group.backend == "gloo" else 0.001
    while True:
        wake.clear()
        if work.is_completed():
            break
        reason = abort()
        if reason is not None:
            raise WeightSyncError(reason)
        left = deadline - time.monotonic()
        if left <= 0:
            raise WeightSyncError(f"broadcast not received within the deadline ({group.timeout_s:.1f} s)")
        wake.wait(min(left, poll_s))
    try:
        work.wait()
    except RuntimeError as exc:  # gloo reports a peer's failure or timeout this way
        raise WeightSyncError(f"broadcast failed: {exc}") from exc
