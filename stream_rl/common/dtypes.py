"""The dtypes a model is loaded in (`model.dtype`) and a weight update carries, by name."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""Dtype names and their torch dtypes: `model.dtype`'s choices, and the only dtypes on the wire."""

DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
