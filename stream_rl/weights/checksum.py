"""A checksum of model weights, identical wherever the same bytes are held.

`weights_checksum` is recorded in every `WeightVersion` event (the trainer), compared after a
replay (bit-exact on CPU) and used by tests to prove that a broadcast delivered every byte.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

from stream_rl.weights.buckets import TensorMeta, tensor_bytes

# Tensors are hashed in pieces so that a large one is never copied whole to the CPU.
_CHUNK_BYTES = 64 << 20


def weights_checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 (hex) over each tensor's name, dtype, shape and raw bytes, in the given order.

    Each tensor contributes the header `name\\0dtype\\0d0,d1,...\\0nbytes\\0` and then its bytes,
    so renaming, reshaping or reordering changes the checksum. Only the wire dtypes
    (float32, bfloat16, float16) are accepted.
    """
    digest = hashlib.sha256()
    for name, tensor in named_tensors:
        meta = TensorMeta.from_tensor(name, tensor)
        shape = ",".join(map(str, meta.shape))
        digest.update(f"{meta.name}\0{meta.dtype}\0{shape}\0{meta.nbytes}\0".encode())
        raw = tensor_bytes(tensor)
        for start in range(0, raw.numel(), _CHUNK_BYTES):
            digest.update(raw[start : start + _CHUNK_BYTES].cpu().numpy().data)
    return digest.hexdigest()
