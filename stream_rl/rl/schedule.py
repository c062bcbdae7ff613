"""Learning-rate schedule: linear warm-up, then cosine decay to `min_lr_ratio * lr` (pure python).

Use with `torch.optim.lr_scheduler.LambdaLR(optimizer, make_lr_lambda(...))`, calling
`scheduler.step()` after each `optimizer.step()`. The lambda receives `k`, the number of
optimizer steps already taken, and returns the factor on the peak lr for the next step:
- warm-up (`k < warmup_steps`): `(k + 1) / warmup_steps`, so the first step is not wasted at lr 0
  and step `warmup_steps - 1` runs at the peak;
- then cosine over the remaining `max_steps - warmup_steps` steps:
  `min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * progress)) / 2`, progress in [0, 1];
- after `max_steps`: `min_lr_ratio`.
`min_lr_ratio = 1.0` (the config default) gives a constant lr after warm-up.
Parameter names match `TrainerConfig`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def lr_factor(step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """The lr multiplier for the optimizer step that follows `step` completed steps."""
    if warmup_steps < 0 or max_steps < 1 or not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(
            f"lr schedule: need warmup_steps >= 0, max_steps >= 1, 0 <= min_lr_ratio <= 1 "
            f"(got {warmup_steps}, {max_steps}, {min_lr_ratio})"
        )
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max_steps - warmup_steps
    if decay_steps <= 0:
        return 1.0 if step < max_steps else min_lr_ratio
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class WarmupCosine:
    """The schedule as a picklable callable (LambdaLR stores its fields in `state_dict()`)."""

    warmup_steps: int
    max_steps: int
    min_lr_ratio: float

    def __post_init__(self) -> None:
        self(0)  # validate the parameters now, not at the first step

    def __call__(self, step: int) -> float:
        return lr_factor(
            step, warmup_steps=self.warmup_steps, max_steps=self.max_steps, min_lr_ratio=self.min_lr_ratio
        )


def make_lr_lambda(*, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> WarmupCosine:
    """The lr lambda for `LambdaLR`; raises ValueError on invalid parameters."""
    return WarmupCosine(warmup_steps=warmup_steps, max_steps=max_steps, min_lr_ratio=min_lr_ratio)
