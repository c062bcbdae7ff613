"""Smaller full-model pushes: the dtype on the wire, and only the tensors that changed.

Two options of `WeightSender` (`trainer.push_dtype`, `trainer.push_delta_threshold`;
docs/weight-pushes.md), both within the existing protocol (an update may carry any subset of the
server's tensors, each in the server's dtype):

- **Cast to the server's dtype** (`push_dtype="server"`): each tensor is converted to the dtype the
  server lists for it in `GET /weights/meta` before it is packed. float32 -> bfloat16 is torch's
  conversion, round-to-nearest-even on the bit pattern (NaN and infinities kept), so a server
  holding bfloat16 ends up with exactly `trainer_tensor.to(torch.bfloat16)`, and the bytes halve.
- **Delta** (`delta_threshold` not None): the sender keeps what every server at the last pushed
  version holds (`HeldWeights`: one copy of the model in the wire dtype) and sends a server that
  holds that version only the tensors that moved by more than the threshold since (max absolute
  difference over the tensor, in float32; threshold 0: any bit differs). Tensors not sent keep
  their held values, on the servers and in the copy, so every server labelled `v` holds the same
  bytes (the copy's): with threshold 0 exactly the trainer's weights, above 0 each tensor within
  the threshold of the trainer's. A server at any other version (new, re-joined, missed a push)
  gets every tensor of the copy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from stream_rl.errors import WeightSyncError
from stream_rl.weights.buckets import TensorMeta, tensor_bytes

PUSH_DTYPES = ("trainer", "server")


def check_push_options(push_dtype: str, delta_threshold: float | None) -> None:
    if push_dtype not in PUSH_DTYPES:
        raise WeightSyncError(f"push_dtype must be one of {', '.join(PUSH_DTYPES)}, got {push_dtype!r}")
    if delta_threshold is not None and not delta_threshold >= 0:
        raise WeightSyncError(f"delta_threshold must be >= 0 or None, got {delta_threshold}")


def server_dtypes(names: Sequence[str], servers: Mapping[str, Mapping[str, TensorMeta]]) -> dict[str, str]:
    """name -> the dtype the servers hold it in (`GET /weights/meta`), for tensors they know.

    Raises `WeightSyncError` when two servers hold a tensor in different dtypes (one cast serves
    every server of a push)."""
    out: dict[str, str] = {}
    owner: dict[str, str] = {}
    for url, metas in servers.items():
        for name in names:
            meta = metas.get(name)
            if meta is None:
                continue
            if name in out and out[name] != meta.dtype:
                raise WeightSyncError(
                    f"push_dtype server: {name} is {out[name]} on {owner[name]} but {meta.dtype} on {url}; "
                    "servers of one trainer must hold the same dtypes"
                )
            out[name], owner[name] = meta.dtype, url
    return out


def cast_to(
    named: Sequence[tuple[str, torch.Tensor]], dtypes: Mapping[str, str]
) -> list[tuple[str, torch.Tensor]]:
    """Each tensor converted to `dtypes[name]` (unchanged, not copied, when it already is, or when
    the name is unknown: the check against the server then reports it)."""
    out = []
    for name, tensor in named:
        wanted = dtypes.get(name)
        if wanted is not None:
            tensor = tensor.detach().to(TensorMeta(name, wanted, tuple(tensor.shape)).torch_dtype)
        out.append((name, tensor))
    return out


def moved(new: torch.Tensor, held: torch.Tensor, threshold: float) -> bool:
    """Whether `new` differs from `held` beyond `threshold` (0: any byte; NaN always counts)."""
    if threshold == 0:
        return not torch.equal(tensor_bytes(new), tensor_bytes(held))
    if new.numel() == 0:
        return False
    diff = new.to(torch.float32, copy=True).sub_(held).abs_()  # never in place on the trainer's tensor
    return not bool(diff.amax() <= threshold)  # amax propagates NaN, and NaN <= t is False


class HeldWeights:
    """What every server at `version` holds: one copy of the pushed tensors, advanced per version."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.version: int | None = None
        self.tensors: dict[str, torch.Tensor] = {}

    def advance(self, version: int, named: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
        """Take `version`: copy in the tensors that moved beyond the threshold; returns their names
        (every name on the first call, or when the tensors' names, dtypes or shapes changed)."""
        same_layout = list(self.tensors) == [n for n, _ in named] and all(
            self.tensors[n].dtype == t.dtype and self.tensors[n].shape == t.shape for n, t in named
        )
        if not same_layout:
            self.tensors = {name: tensor.detach().clone() for name, tensor in named}
            self.version = version
            return list(self.tensors)
        changed = []
        for name, tensor in named:
            held = self.tensors[name]
            if moved(tensor.detach(), held, self.threshold):
                held.copy_(tensor.detach())
                changed.append(name)
        self.version = version
        return changed

    def named(self, names: Sequence[str] | None = None) -> list[tuple[str, torch.Tensor]]:
        """The held tensors (all, or `names`), in push order."""
        if names is None:
            return list(self.tensors.items())
        wanted = set(names)
        return [(n, t) for n, t in self.tensors.items() if n in wanted]

    def forget(self) -> None:
        self.version = None
        self.tensors = {}
