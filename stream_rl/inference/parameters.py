"""The served model's parameters by name, and the shadow buffers in-flight updates fill.

Names are those of `model.named_parameters()` (tied parameters listed once, under their first
name, e.g. `model.embed_tokens.weight` for a tied `lm_head.weight`); an update may also use a
tied alias, but may not name the same parameter twice. An update installs new tensors by
pointer swap (`param.data = shadow`), and the tensors it replaced become the shadow buffers
of the next update, so steady-state updates allocate nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from stream_rl.common.dtypes import DTYPE_NAMES, DTYPES
from stream_rl.errors import WeightSyncError


@dataclass(frozen=True)
class ParamSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]


class ParameterTable:
    def __init__(self, model: torch.nn.Module) -> None:
        self._params = dict(model.named_parameters(remove_duplicate=False))
        self._canonical: dict[int, str] = {}
        for name, param in model.named_parameters():
            self._canonical[id(param)] = name
        self._specs = [
            ParamSpec(name, DTYPE_NAMES.get(p.dtype, str(p.dtype)), tuple(p.shape))
            for name, p in model.named_parameters()
        ]
        self._pool: dict[str, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def specs(self) -> list[ParamSpec]:
        """Every distinct parameter, in `named_parameters()` order."""
        return list(self._specs)

    def canonical(self, name: str) -> str:
        return self._canonical[id(self._params[name])]

    def check(self, specs: Iterable[ParamSpec]) -> None:
        """Raise WeightSyncError when a spec names no parameter, repeats one, or mismatches it."""
        seen: dict[str, str] = {}
        problems = []
        for spec in specs:
            param = self._params.get(spec.name)
            if param is None:
                problems.append(f"{spec.name}: no such parameter (GET /weights/meta lists them)")
                continue
            canonical = self.canonical(spec.name)
            if canonical in seen:
                problems.append(f"{spec.name}: same parameter as {seen[canonical]} (tied); send it once")
                continue
            seen[canonical] = spec.name
            if spec.dtype not in DTYPES:
                problems.append(f"{spec.name}: dtype {spec.dtype!r} is not one of {', '.join(DTYPES)}")
            elif DTYPES[spec.dtype] != param.dtype:
                problems.append(
                    f"{spec.name}: dtype {spec.dtype}, but the model holds {DTYPE_NAMES.get(param.dtype, param.dtype)}"
                )
            if tuple(spec.shape) != tuple(param.shape):
                problems.append(
                    f"{spec.name}: shape {list(spec.shape)}, but the model holds {list(param.shape)}"
                )
        if problems:
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            raise WeightSyncError(f"update does not match the served model: {shown}")

    def shadow_buffers(self, specs: Iterable[ParamSpec]) -> dict[str, torch.Tensor]:
        """One uninitialised buffer per spec (same dtype, shape and device as the parameter),
        reused from earlier updates when possible. Keys are canonical names."""
        out = {}
        with self._lock:
            for spec in specs:
                name = self.canonical(spec.name)
                param = self._params[name]
                pooled = self._pool.get(name)
                if pooled:
                    out[name] = pooled.pop()
                else:
                    out[name] = torch.empty_like(param.data, memory_format=torch.contiguous_format)
        return out

    def install(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Swap the tensors in (pointer swap, no copy); return the tensors they replaced.

        Call only between forward passes (the engine does, at a decode-step boundary)."""
        replaced = {}
        for name, tensor in tensors.items():
            param = self._params[name]
            replaced[name] = param.data
            param.data = tensor
        return replaced

    def recycle(self, tensors: dict[str, torch.Tensor]) -> None:
        """Keep tensors (replaced by, or unused in, an update) as future shadow buffers."""
        with self._lock:
            for name, tensor in tensors.items():
                self._pool.setdefault(self.canonical(name), []).append(tensor)

    def get(self, name: str) -> torch.Tensor:
        """The parameter's current data."""
        return self._params[name].data
