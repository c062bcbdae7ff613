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
    in_flight: deque[InFlight] = deque()
    offset = 0
    posted = 0  # buckets broadcast so far: picks the staging slot
    for bucket in plan:
        tensors = sources[offset : offset + len(bucket)]
        offset += len(bucket)
        size = bucket_nbytes(bucket)
        if size == 0:  # only empty tensors: nothing travels (the receiver skips it too)
            continue
        if len(tensors) == 1 and tensors[0].device == device and tensors[0].is_contiguous():
            payload = tensor_bytes(tensors[0])
        else:
            # Free: the bucket posted two before this one (the slot's last user) has completed.
            buffer = group.staging(posted % IN_FLIGHT, max(ring_bytes, size))
            payload = pack_bucket(tensors, out=buffer)
        in_flight.append(InFlight(group.broadcast(payload, deadline - time.monotonic()), group.backend, wake))
        posted += 1
        if len(in_flight) == IN_FLIGHT:
            await_work(in_flight.popleft(), group, deadline=deadline, abort=abort, wake=wake)
    while in_flight:
        await_work(in_flight.popleft(), group, deadline=deadline, abort=abort, wake=wake)


class InFlight:
    """A started collective and how to tell that it ended.

    Gloo: its future's completion, which also sets `wake` (`Work.is_completed()` turns true a
    little after the future's callbacks ran, so it could miss the wake-up). NCCL: the future
    completes before the GPU does, so `is_completed()` (the CUDA event) is polled.
    """

    def __init__(self, work: dist.Work, backend: str, wake: threading.Event) -> None:
        self.work = work
        self.poll_s = 0.05 if backend == "gloo" else 0.001
        self._future = work.get_future() if backend == "gloo" else None
        if self._future is not None:
            self._future.add_done_callback(lambda _f: wake.set())

    def done(self) -> bool:
        return self._future.done() if self._future is not None else self.work.is_completed()


def await_work(
    item: InFlight,
    group: SyncGroup,
    *,
    deadline: float,
    abort: Callable[[], str | None],
    wake: threading.Event,
) -> None:
    """Wait for one collective, giving up on `abort()` or at the deadline."""
    while True:
        wake.clear()
        if item.done():
            break
        reason = abort()
        if reason is not None:
            raise WeightSyncError(reason)
        left = deadline - time.monotonic()
        if left <= 0:
            raise WeightSyncError(f"broadcast not received within the deadline ({group.timeout_s:.1f} s)")
        wake.wait(min(left, item.poll_s))
    try:
        item.work.wait()
    except RuntimeError as exc:  # gloo reports a peer's failure or timeout this way
        if any(word in str(exc).lower() for word in ("timeout", "timed out")):
            # gloo's own timer (the group's timeout) can fire just before ours: same cause. gloo
            # says "Timed out waiting 2992ms for send operation to complete" for a send.
            raise WeightSyncError(
                f"broadcast not received within the deadline ({group.timeout_s:.1f} s): {exc}"
            ) from exc
        raise WeightSyncError(f"broadcast failed: {exc}") from exc
