"""Mixed-precision bookkeeping of the torch trainer: float32 master weights for a bf16 model.

With `model.dtype: bfloat16` the model's parameters (the ones forward and backward run on, and the
ones pushed to the servers) are bf16, except an untied lm_head, kept float32
(`stream_rl.common.modeling`). AdamW on bf16 parameters would lose every update smaller than bf16's
resolution (2^-8 relative: an lr of 1e-6 changes nothing), so, as DeepSpeed's bf16 mode and
PipelineRL's trainer do, the optimizer steps float32 **master** copies:

- after each micro-batch's backward, `accumulate()` adds the bf16 gradients into float32
  gradient buffers of the masters and frees the bf16 ones (accumulation across micro-batches in
  float32, not bf16);
- the optimizer (built on `masters`) clips and steps the float32 copies;
- `publish()` copies the masters back into the model's parameters (rounded to bf16): the
  weights the next forward uses, the checksum covers and the servers receive.

Parameters already float32 (the fp32 lm_head, or a float32 model) are their own masters: nothing
is copied for them. The masters are part of a checkpoint (`state_dict`), so a resumed run keeps
the float32 precision; without them it restarts from the rounded bf16 weights.
"""

from __future__ import annotations

import torch
from torch import nn


class MasterWeights:
    """Float32 copies of a model's low-precision trainable parameters."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.masters: list[torch.Tensor] = []
        for p in params:
            if p.dtype == torch.float32:
                self.masters.append(p)
            else:
                master = p.detach().float().clone()
                master.requires_grad_(True)
                self.masters.append(master)
        self.mixed = any(m is not p for m, p in zip(self.masters, params, strict=True))

    def accumulate(self) -> None:
        """Move the parameters' gradients into the masters' float32 gradients (summing)."""
        if not self.mixed:
            return
        for p, m in zip(self.params, self.masters, strict=True):
            if m is p or p.grad is None:
                continue
            grad = p.grad.float()
            if m.grad is None:
                m.grad = grad
            else:
                m.grad.add_(grad)
            p.grad = None

    @torch.no_grad()
    def publish(self) -> None:
        """Copy the masters into the model's parameters (after an optimizer step)."""
        if not self.mixed:
            return
        for p, m in zip(self.params, self.masters, strict=True):
            if m is not p:
                p.copy_(m)

    def state_dict(self) -> dict[str, list[torch.Tensor]]:
        """The float32 masters of the low-precision parameters, in parameter order."""
        return {
            "masters": [
                m.detach().clone() for m, p in zip(self.masters, self.params, strict=True) if m is not p
            ]
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, list[torch.Tensor]]) -> None:
        own = [m for m, p in zip(self.masters, self.params, strict=True) if m is not p]
        saved = state["masters"]
        if len(saved) != len(own):
            raise ValueError(f"checkpoint holds {len(saved)} master weights, the model has {len(own)}")
        for m, s in zip(own, saved, strict=True):
            m.copy_(s)
        self.publish()
