"""LoRA updates on the wire: adapter tensors instead of the weights they change.

A trainer with `trainer.lora` trains low-rank adapters of some linear layers and leaves every
other weight at the base model's. A built-in server that holds the same base weights needs only
the adapters to serve a version (`POST /weights/update_lora`, docs/weights-protocol.md):

- each targeted weight `W` (a 2-D parameter named as in `named_parameters()`, e.g.
  `model.layers.0.self_attn.q_proj.weight`, shape [out, in]) travels as two tensors,
  `<name>.lora_A` ([r, in]) and `<name>.lora_B` ([out, r]), in the usual buckets
  (`stream_rl.weights.buckets`);
- the served weight is `merge(W0, A, B, scale)`: `W0 + scale * (B @ A)` computed in float64 and
  rounded once to W0's dtype, with `W0` the base weight and `scale = alpha / r`. Both sides
  call this function, so the trainer's checksum of the merged weights is the server's;
- the update also names the checksum of the server's expected base weights (`base_checksum`:
  `weights_checksum` of every parameter, as at version 0). A server whose weights are not that
  base refuses the update, so it never merges adapters into other weights.

Weights not named keep their base value. `MergedWeights` is the trainer's side of one version:
the full merged weights (what the checksum covers and senders without LoRA support push) with
the adapters attached for those that have it (`WeightSender`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from stream_rl.errors import WeightSyncError
from stream_rl.weights.buckets import TensorMeta

SUFFIX_A = ".lora_A"
SUFFIX_B = ".lora_B"


def merge(
    base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`base + scale * (b @ a)`, computed in float64, rounded once to `base`'s dtype: into `out`
    when given (same dtype and shape as `base`), else a new tensor on `base`'s device. The same
    bytes wherever it runs on the same inputs: float64 sums of `r` products each, rounded to
    float32 or bf16. (One float64 product, then one add that reads the base and writes the
    rounded result: measured ~1.3x faster than converting the base to float64 first; a float32
    `addmm` is ~20x faster but rounds the product, and its bytes would depend on the BLAS path.)"""
    delta = torch.mm(b.to(torch.float64), a.to(torch.float64))
    if out is None:
        out = torch.empty_like(base, memory_format=torch.contiguous_format)
    return torch.add(base, delta, alpha=scale, out=out)


@dataclass
class LoraTensors:
    """One version's adapters: `pairs` of (targeted weight name, A [r, in], B [out, r])."""

    scale: float
    pairs: list[tuple[str, torch.Tensor, torch.Tensor]]
    base_checksum: str

    def named(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors of the update, in wire order: each weight's A, then its B."""
        out: list[tuple[str, torch.Tensor]] = []
        for name, a, b in self.pairs:
            out += [(name + SUFFIX_A, a.detach()), (name + SUFFIX_B, b.detach())]
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.named())


class MergedWeights(list[tuple[str, torch.Tensor]]):
    """The full merged weights of a version (a plain list of named tensors, in the model's order)
    with its `lora` adapters attached: a sender that knows `update_lora` pushes those instead."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]], lora: LoraTensors) -> None:
        super().__init__(named)
        self.lora = lora


def adapters_of(named: Sequence[tuple[str, torch.Tensor]]) -> LoraTensors | None:
    """The adapters attached to a push's tensors, if any (a LoRA trainer's `MergedWeights`)."""
    lora = getattr(named, "lora", None)
    return lora if isinstance(lora, LoraTensors) else None


@dataclass(frozen=True)
class LoraPair:
    """One targeted weight of an update: its name and the metas of its A and B."""

    name: str
    a: TensorMeta
    b: TensorMeta


def pair_metas(metas: Sequence[TensorMeta], weights: dict[str, TensorMeta]) -> list[LoraPair]:
    """The update's tensors as (A, B) pairs of the weights in `weights` (name -> the weight's
    meta, e.g. a server's `GET /weights/meta`). Raises `WeightSyncError` naming what is wrong:
    a name without the `.lora_A`/`.lora_B` suffix, an unknown or non-2-D weight, a missing half,
    or shapes that do not make `B @ A` the weight's shape."""
    halves: dict[str, dict[str, TensorMeta]] = {}
    problems: list[str] = []
    for meta in metas:
        for suffix in (SUFFIX_A, SUFFIX_B):
            if meta.name.endswith(suffix):
                side = halves.setdefault(meta.name[: -len(suffix)], {})
                if suffix in side:
                    problems.append(f"{meta.name}: sent twice")
                side[suffix] = meta
                break
        else:
            problems.append(f"{meta.name}: not a LoRA tensor (names end in {SUFFIX_A} or {SUFFIX_B})")
    pairs = []
    for name, side in halves.items():
        weight = weights.get(name)
        if weight is None:
            problems.append(f"{name}: no such weight (GET /weights/meta lists them)")
            continue
        if len(weight.shape) != 2:
            problems.append(f"{name}: {weight.describe()} is not a matrix")
            continue
        a, b = side.get(SUFFIX_A), side.get(SUFFIX_B)
        if a is None or b is None:
            problems.append(f"{name}: {SUFFIX_A if a is None else SUFFIX_B} missing")
            continue
        out, inner = weight.shape
        if (
            len(a.shape) != 2
            or len(b.shape) != 2
            or a.shape[1] != inner
            or b.shape[0] != out
            or a.shape[0] != b.shape[1]
        ):
            problems.append(
                f"{name}: A {a.describe()} and B {b.describe()} do not give {weight.describe()} "
                "(A is [r, in], B is [out, r])"
            )
            continue
        pairs.append(LoraPair(name, a, b))
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise WeightSyncError(f"LoRA update does not match the served model: {shown}")
    return pairs
