"""Tensor descriptions and the bucket layout of a weight broadcast.

The wire layout (the server contract of `POST /weights/update`):
- the tensors are listed in order, each as `{name, dtype, shape}` (`TensorMeta.to_dict`);
- `plan_buckets` groups them, in that order, into buckets of at most `bucket_bytes`; a tensor
  bigger than `bucket_bytes` travels alone in its own bucket;
- each bucket travels as one 1-D `uint8` tensor holding its tensors' raw bytes back to back,
  no padding, no conversion (bfloat16 included: the bytes are reinterpreted, never cast);
- buckets of zero bytes (only empty tensors) are not broadcast at all.

Both sides call `plan_buckets` with the same list and size, so they agree on every bucket
without sending the plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

import torch

from stream_rl.common.dtypes import DTYPE_NAMES, DTYPES
from stream_rl.errors import WeightSyncError


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of an update: its `named_parameters()` name, wire dtype and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise WeightSyncError(
                f"tensor {self.name!r}: dtype {self.dtype!r} is not one of {', '.join(DTYPES)}"
            )
        if any(d < 0 for d in self.shape):
            raise WeightSyncError(f"tensor {self.name!r}: negative dimension in shape {self.shape}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize

    def describe(self) -> str:
        """`float32[64, 128]`: for error messages."""
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TensorMeta:
        try:
            name, dtype, shape = data["name"], data["dtype"], data["shape"]
        except (KeyError, TypeError) as exc:
            raise WeightSyncError(f"tensor description {data!r} lacks name, dtype or shape") from exc
        if not isinstance(name, str) or not isinstance(dtype, str) or not isinstance(shape, list | tuple):
            raise WeightSyncError(
                f"tensor description {data!r}: name and dtype must be strings, shape a list"
            )
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise WeightSyncError(f"tensor {name!r}: shape {shape!r} must be a list of integers")
        return cls(name=name, dtype=dtype, shape=tuple(shape))

    @classmethod
    def from_tensor(cls, name: str, tensor: torch.Tensor) -> TensorMeta:
        dtype = DTYPE_NAMES.get(tensor.dtype)
        if dtype is None:
            raise WeightSyncError(
                f"tensor {name!r} has dtype {tensor.dtype}; weight updates carry only {', '.join(DTYPES)}"
            )
        return cls(name=name, dtype=dtype, shape=tuple(tensor.shape))


def plan_buckets(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    """Group `metas`, in order, into buckets of at most `bucket_bytes` bytes.

    A tensor bigger than `bucket_bytes` closes the current bucket and travels alone.
    """
    if bucket_bytes < 1:
        raise WeightSyncError(f"bucket_bytes must be at least 1, got {bucket_bytes}")
    buckets: list[list[TensorMeta]] = []
    current: list[TensorMeta] = []
    current_bytes = 0
    for meta in metas:
        size = meta.nbytes
        if size > bucket_bytes:
            if current:
                buckets.append(current)
                current, current_bytes = [], 0
            buckets.append([meta])
            continue
        if current and current_bytes + size > bucket_bytes:
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(meta)
        current_bytes += size
    if current:
        buckets.append(current)
    return buckets


def bucket_nbytes(bucket: Sequence[TensorMeta]) -> int:
    return sum(meta.nbytes for meta in bucket)


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of `tensor` as a 1-D uint8 tensor: a view when it is contiguous."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def pack_bucket(tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The raw bytes of `tensors`, back to back, as one 1-D uint8 tensor (on their device).

    A single contiguous tensor is returned as a view of its bytes (no copy). With `out` (a 1-D
    uint8 tensor of at least the total size), the bytes are written into its prefix, which is
    returned: the sender reuses a few buffers instead of allocating one per bucket.
    """
    if not tensors:
        raise WeightSyncError("cannot pack an empty bucket")
    parts = [tensor_bytes(t) for t in tensors]
    if len(parts) == 1 and out is None:
        return parts[0]
    total = sum(p.numel() for p in parts)
    if out is None:
        out = torch.empty(total, dtype=torch.uint8, device=parts[0].device)
    elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < total:
        raise WeightSyncError(f"pack buffer must be 1-D uint8 of at least {total} bytes")
    buf = out[:total]
    if all(p.device == buf.device for p in parts):
        torch.cat(parts, out=buf)  # one call: ~30% faster than a copy per tensor on CPU
        return buf
    offset = 0
    for part in parts:
        buf[offset : offset + part.numel()].copy_(part)
        offset += part.numel()
    return buf


def byte_slices(buf: torch.Tensor, metas: Sequence[TensorMeta]) -> list[tuple[TensorMeta, torch.Tensor]]:
    """Each tensor's raw bytes within a received bucket: 1-D uint8 views, no copy."""
    expected = bucket_nbytes(metas)
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != expected:
        raise WeightSyncError(
            f"bucket holds {buf.numel()} {buf.dtype} elements, expected {expected} uint8 bytes"
        )
    return list(zip(metas, torch.split(buf, [m.nbytes for m in metas]), strict=True))


def as_typed(raw: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """Reinterpret raw bytes as `meta`'s dtype and shape: a view when the offset is aligned.

    Tensors lie back to back without padding, so a float32 after an odd number of bfloat16
    values starts at an offset torch cannot view as float32; those are copied first.
    """
    dtype = meta.torch_dtype
    if raw.storage_offset() % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype).view(meta.shape)


def unpack_bucket(buf: torch.Tensor, metas: Sequence[TensorMeta]) -> list[tuple[TensorMeta, torch.Tensor]]:
    """Split a received bucket into typed tensors (views of `buf`, copies only where misaligned)."""
    return [(meta, as_typed(raw, meta)) for meta, raw in byte_slices(buf, metas)]
