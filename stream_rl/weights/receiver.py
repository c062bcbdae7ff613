"""The inference server's side of a weight update: join the group, receive buckets into buffers.

Contract (see `stream_rl.weights.buckets` for the wire layout):
- `WeightReceiver(...)` joins the group whose rank 0 hosts the store at master_addr:master_port
  and returns once the group is formed (handshake done); it never touches the default group.
- `receive(metas, bucket_bytes, into)` receives one update: `into(meta)` is called exactly once
  per tensor, in the listed order (when its bucket is posted), and returns the tensor (shape and dtype of `meta`, any
  device) that the tensor's bytes are copied into — typically a shadow buffer that the server
  swaps in at a decode-step boundary once `receive` returns. It returns the wall time in ms.
- The whole update must arrive within `timeout_s` of the call: every collective is polled
  against that deadline (never waited on blindly), and on expiry the group is aborted (NCCL) and
  `WeightSyncError` raised. Any failure raises `WeightSyncError` and leaves the receiver broken:
  the server should `close()` it and wait for the trainer to re-join it (`POST /weights/init_group`).

CUDA destinations (`device` a CUDA device): nothing of a receive runs on the default stream,
which the engine's decode thread uses. Staging buffers, the collectives' ordering (NCCL), and the
copies into the destinations all run on the receiver's own stream (`stream`), which first waits
for the work already queued on the default stream (so a recycled buffer that the last decode
steps still read is not overwritten early). When `receive` returns, the copies may still be in
flight on that stream: `ready` is a CUDA event recorded after them, and whoever uses the
destinations on another stream waits for it (the engine's swap does: `Engine.swap_weights(...,
ready=)`), a wait on the GPU, not on the host. CPU destinations: `ready` is None and the bytes are
in place when `receive` returns.

Two buckets are in flight: the next bucket is received while the previous one is copied out.
A bucket holding one contiguous tensor whose destination sits on the group's device is
received straight into the destination (no staging copy).

Not thread-safe: one `receive` at a time (the server serialises updates).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from stream_rl.errors import WeightSyncError
from stream_rl.weights.broadcast import InFlight, await_work
from stream_rl.weights.buckets import (
    TensorMeta,
    as_typed,
    bucket_nbytes,
    byte_slices,
    plan_buckets,
    tensor_bytes,
)
from stream_rl.weights.group import SyncGroup, check_backend, cuda_device, local_address_towards, on_stream

_IN_FLIGHT = 2


def _never() -> str | None:
    return None


@dataclass
class _Pending:
    bucket: list[TensorMeta]
    dsts: list[torch.Tensor]
    target: torch.Tensor
    direct: bool
    work: InFlight


def check_destination(dst: torch.Tensor, meta: TensorMeta) -> None:
    """`into(meta)` must return a tensor of exactly `meta`'s dtype and shape."""
    if dst.dtype != meta.torch_dtype or tuple(dst.shape) != meta.shape:
        raise WeightSyncError(
            f"destination of {meta.name!r} is {dst.dtype}{list(dst.shape)}, the update sends {meta.describe()}"
        )


def _direct_target(dsts: list[torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """The bytes of a lone destination that can be received into in place, else None."""
    if len(dsts) == 1 and dsts[0].is_contiguous() and dsts[0].device == device:
        return tensor_bytes(dsts[0])
    return None


class WeightReceiver:
    """Membership (rank >= 1) of a weight-sync group, receiving updates broadcast by rank 0."""

    def __init__(
        self,
        *,
        master_addr: str,
        master_port: int,
        rank: int,
        world_size: int,
        backend: str,
        timeout_s: float,
        device: str = "cpu",
    ) -> None:
        """Join the group (blocks until it is formed, at most about `timeout_s`)."""
        check_backend(backend)
        if rank < 1:
            raise WeightSyncError(f"a receiver's rank must be at least 1 (rank 0 is the trainer), got {rank}")
        self.timeout_s = timeout_s
        self._broken: str | None = None
        try:
            store = dist.TCPStore(
                master_addr, master_port, world_size, False, timeout=timedelta(seconds=timeout_s)
            )
        except RuntimeError as exc:  # DistNetworkError / DistStoreError
            raise WeightSyncError(
                f"cannot reach the weight-sync store at {master_addr}:{master_port}: {exc}"
            ) from exc
        self._group: SyncGroup | None = SyncGroup(
            store,
            rank=rank,
            world_size=world_size,
            backend=backend,
            timeout_s=timeout_s,
            local_addr=local_address_towards(master_addr),
            device=device,
        )
        dest = cuda_device(device)
        self.stream: torch.cuda.Stream | None = None
        """The stream every receive runs on (CUDA destinations only)."""
        if dest.type == "cuda":
            self.stream = self._group.stream or torch.cuda.Stream(dest)
        self.ready: torch.cuda.Event | None = None
        """CUDA: the event after the last receive's copies (wait for it before reading them)."""

    @property
    def group(self) -> SyncGroup:
        if self._group is None:
            raise WeightSyncError("the weight receiver is closed")
        if self._broken is not None:
            raise WeightSyncError(f"the weight-sync group is broken ({self._broken}); it must be re-joined")
        return self._group

    def receive(
        self,
        metas: Sequence[TensorMeta],
        bucket_bytes: int,
        into: Callable[[TensorMeta], torch.Tensor],
    ) -> float:
        """Receive one update, copying each tensor's bytes into `into(meta)`; returns ms."""
        group = self.group
        start = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        plan = plan_buckets(metas, bucket_bytes)
        staged = [b for b in plan if len(b) > 1]
        ring_bytes = max((bucket_nbytes(b) for b in staged), default=0)
        pending: deque[_Pending] = deque()
        wake = threading.Event()
        done = False
        self.ready = None
        try:
            with on_stream(self.stream):
                if self.stream is not None:
                    # Ordered after everything already queued on the default stream (the decode
                    # steps that read the buffers being recycled), and nothing queued later.
                    self.stream.wait_stream(torch.cuda.default_stream(self.stream.device))
                posted = 0  # buckets posted so far: picks the staging slot (empty ones are skipped)
                for bucket in plan:
                    size = bucket_nbytes(bucket)
                    if size == 0:  # only empty tensors: nothing travels
                        for meta in bucket:
                            check_destination(into(meta), meta)
                        continue
                    dsts = [into(meta) for meta in bucket]
                    for meta, dst in zip(bucket, dsts, strict=True):
                        check_destination(dst, meta)
                    target = _direct_target(dsts, group.device)
                    direct = target is not None
                    if target is None:
                        # Free: the bucket posted two before (the slot's last user) was copied out.
                        target = group.staging(posted % _IN_FLIGHT, max(ring_bytes, size))[:size]
                    work = group.broadcast(target, max(deadline - time.monotonic(), 0.001))
                    pending.append(
                        _Pending(bucket, dsts, target, direct, InFlight(work, group.backend, wake))
                    )
                    posted += 1
                    if len(pending) == _IN_FLIGHT:
                        self._finish(pending.popleft(), deadline, wake)
                while pending:
                    self._finish(pending.popleft(), deadline, wake)
                if self.stream is not None:
                    self.ready = torch.cuda.Event()
                    self.ready.record(self.stream)
            done = True
        except WeightSyncError as exc:
            self._broken = str(exc)
            group.abort()  # NCCL: end the stuck collective now (gloo ends it at its timeout)
            raise
        finally:
            # Whatever interrupted the update (even an error in `into`), the two sides no longer
            # agree on which broadcast comes next: the group cannot be used again.
            if not done and self._broken is None:
                self._broken = "an update was interrupted"
        return (time.perf_counter() - start) * 1000.0

    def _finish(self, item: _Pending, deadline: float, wake: threading.Event) -> None:
        """Wait (polling, until `deadline`) for one bucket, then copy it out (on `stream`)."""
        try:
            # Polls completion (NCCL: its CUDA event), then `wait()`s, which for NCCL only makes
            # the current stream (ours) wait for the collective's stream.
            await_work(item.work, self.group, deadline=deadline, abort=_never, wake=wake)
        except WeightSyncError as exc:
            raise WeightSyncError(f"receiving weights failed: {exc}") from exc
        if item.direct:
            return
        for (meta, raw), dst in zip(byte_slices(item.target, item.bucket), item.dsts, strict=True):
            if dst.is_contiguous():
                tensor_bytes(dst).copy_(raw)
            else:
                dst.copy_(as_typed(raw, meta))
            if self.stream is not None and dst.is_cuda:
                # The caching allocator must not hand this memory to another stream while our
                # copy into it may still be running (it was allocated on the default stream).
                dst.record_stream(self.stream)

    def close(self) -> None:
        """Leave the group. Safe to call twice."""
        if self._group is not None:
            self._group.close()
            self._group = None
