"""CUDA IPC weight transport: trainer and inference server on the same GPU.

NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so a colocated trainer shares its
memory instead: for each bucket of the `plan_buckets` plan (a parameter's own bytes when it
travels alone, else a packed copy) it sends a CUDA IPC handle, and the server copies the bytes
out into its shadow buffers on its receive stream, then swaps them in at a decode-step boundary
like any other update. No bytes travel over a socket.

The protocol (docs/engines.md "Weight sync"; routes in `stream_rl/inference/ipc_routes.py`):
1. `POST /weights/init_ipc {device_uuid, torch_version}`: the server checks it runs on that very
   GPU (UUIDs are the same in every process whatever `CUDA_VISIBLE_DEVICES` numbering each sees)
   and the same torch (the handle fields below are torch's own `reduce_tensor` layout), else 409
   with the reason.
2. `POST /weights/update_ipc {version, tensors, bucket_bytes, buckets: [handle, ...]}`: one handle
   per non-empty bucket, in plan order. Over HTTP travel only the handles: JSON objects of
   integers and base64 strings (`share`), never a pickle.
3. The server opens each handle (`open_shared`), copies the bucket's tensors out on its receive
   stream (which first waits for the IPC event the trainer's stream recorded when the handle was
   made), waits for those copies (host poll of a CUDA event, within the update's deadline), drops
   its references, and only then answers `{version, receive_ms, stall_ms}`.

Buffer lifetime: the trainer keeps every shared buffer (and does not step the optimizer) until
the answer, or until the update's deadline when there is none; after a failed or timed-out
update it still holds them until the deadline passed, so a server still copying never reads freed
memory. torch's IPC reference counts (a small shared-memory file per handle) let the allocator
reuse a packed buffer only once the server released it (`torch.cuda.ipc_collect`).
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from stream_rl.errors import WeightSyncError
from stream_rl.weights.buckets import (
    TensorMeta,
    as_typed,
    bucket_nbytes,
    byte_slices,
    plan_buckets,
    tensor_bytes,
)
from stream_rl.weights.group import on_stream

_POLL_S = 0.0005


def _b64(raw: bytes | None) -> str | None:
    return None if raw is None else base64.b64encode(raw).decode("ascii")


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


def share(buffer: torch.Tensor) -> dict[str, Any]:
    """A JSON handle to a 1-D uint8 CUDA tensor's bytes, openable by another process on its GPU."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    if not buffer.is_cuda or buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise WeightSyncError("cuda_ipc shares contiguous 1-D uint8 CUDA buffers only")
    rebuild, args = reduce_tensor(buffer)
    if rebuild is not rebuild_cuda_tensor or len(args) != 15:
        raise WeightSyncError(
            f"torch {torch.__version__}: unexpected CUDA IPC reduction layout; cuda_ipc cannot run with it"
        )
    (
        _,
        size,
        _,
        offset,
        _,
        _,
        device,
        handle,
        storage_size,
        storage_offset,
        _,
        ref_handle,
        ref_offset,
        event,
        sync,
    ) = args
    return {
        "device": int(device),
        "handle": _b64(handle),
        "storage_size": int(storage_size),
        "storage_offset": int(storage_offset),
        "offset": int(offset),
        "numel": int(size[0]),
        "ref_counter_handle": _b64(ref_handle),
        "ref_counter_offset": int(ref_offset),
        "event_handle": _b64(event),
        "event_sync_required": bool(sync),
    }


def open_shared(desc: dict[str, Any], device_index: int) -> torch.Tensor:
    """The tensor a `share` handle names, mapped into this process on `device_index` (this
    process's index of the same GPU). Call on the stream that will read it: that stream waits for
    the sharer's IPC event."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        tensor: torch.Tensor = rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size([int(desc["numel"])]),
            (1,),
            int(desc["offset"]),
            torch.storage.TypedStorage,
            torch.uint8,
            device_index,
            _unb64(desc["handle"]),
            int(desc["storage_size"]),
            int(desc["storage_offset"]),
            False,
            _unb64(desc["ref_counter_handle"]),
            int(desc["ref_counter_offset"]),
            _unb64(desc["event_handle"]),
            bool(desc["event_sync_required"]),
        )
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise WeightSyncError(f"cannot open a CUDA IPC handle: {exc}") from exc
    return tensor


def pack_shared(plan: Sequence[Sequence[TensorMeta]], sources: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One 1-D uint8 CUDA buffer per non-empty bucket: a lone contiguous tensor's own bytes (no
    copy), else its tensors packed back to back (a new buffer)."""
    out: list[torch.Tensor] = []
    offset = 0
    for bucket in plan:
        tensors = sources[offset : offset + len(bucket)]
        offset += len(bucket)
        if bucket_nbytes(bucket) == 0:
            continue
        if any(not t.is_cuda for t in tensors):
            raise WeightSyncError("cuda_ipc sends CUDA tensors only (trainer.device: cuda)")
        if len(tensors) == 1 and tensors[0].is_contiguous():
            out.append(tensor_bytes(tensors[0]))
        else:
            out.append(torch.cat([tensor_bytes(t) for t in tensors]))
    return out


def receive_shared(
    metas: Sequence[TensorMeta],
    bucket_bytes: int,
    handles: Sequence[dict[str, Any]],
    into: Callable[[TensorMeta], torch.Tensor],
    *,
    device_index: int,
    stream: torch.cuda.Stream,
    timeout_s: float,
) -> tuple[float, torch.cuda.Event]:
    """Copy one update out of the trainer's shared buckets into `into(meta)` (the server side).

    Returns (ms, event after the copies). Returns only once the copies are complete, so the
    trainer may reuse its buffers after the answer; raises `WeightSyncError` on a malformed
    update or when the copies do not complete within `timeout_s`.
    """
    start = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    plan = plan_buckets(metas, bucket_bytes)
    nonempty = [b for b in plan if bucket_nbytes(b)]
    if len(handles) != len(nonempty):
        raise WeightSyncError(f"the update has {len(nonempty)} non-empty buckets but {len(handles)} handles")
    opened: list[torch.Tensor] = []
    with on_stream(stream):
        stream.wait_stream(torch.cuda.default_stream(stream.device))  # recycled buffers: see receiver.py
        k = 0
        for bucket in plan:
            dsts = [into(meta) for meta in bucket]
            for meta, dst in zip(bucket, dsts, strict=True):
                if dst.dtype != meta.torch_dtype or tuple(dst.shape) != meta.shape:
                    raise WeightSyncError(f"destination of {meta.name!r} does not match {meta.describe()}")
            size = bucket_nbytes(bucket)
            if size == 0:
                continue
            src = open_shared(handles[k], device_index)
            k += 1
            if src.numel() != size:
                raise WeightSyncError(f"shared bucket {k} holds {src.numel()} bytes, the plan says {size}")
            opened.append(src)
            for (meta, raw), dst in zip(byte_slices(src, bucket), dsts, strict=True):
                if dst.is_contiguous():
                    tensor_bytes(dst).copy_(raw)
                else:
                    dst.copy_(as_typed(raw, meta))
                dst.record_stream(stream)
        ready = torch.cuda.Event()
        ready.record(stream)
    while not ready.query():
        if time.monotonic() > deadline:
            raise WeightSyncError(f"copying the shared weights did not finish within {timeout_s:.1f} s")
        time.sleep(_POLL_S)
    opened.clear()  # release the trainer's buffers (their IPC reference counts drop)
    return (time.perf_counter() - start) * 1000.0, ready
