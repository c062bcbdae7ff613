"""Per-group advantages (pure python, float64): the preprocessor calls this once per complete group.

`kind="loo"` (default, PipelineRL's current default) is the leave-one-out baseline
`A_i = r_i - mean_{j != i} r_j`, which equals `n/(n-1) * (r_i - mean)`; `kind="mean"` is the
group-mean baseline `A_i = r_i - mean` (PipelineRL before Nov 2025). With `divide_by_std` the
advantages are divided by `std + eps`, where std is the sample standard deviation of the group's
rewards with ddof=1, as PipelineRL does (`divide_advantage_by_std`). A group of one sample has
no baseline: its advantage is 0. All-equal rewards give all-zero advantages (with or without
`divide_by_std`, since the numerator is 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

AdvantageKind = Literal["loo", "mean"]


def compute_advantages(
    rewards: Sequence[float],
    kind: AdvantageKind = "loo",
    divide_by_std: bool = False,
    eps: float = 1e-4,
) -> list[float]:
    """Advantages of one group's samples, in the order of `rewards`.

    `kind` and `divide_by_std` match `PreprocessorConfig.advantage` / `.divide_by_std`.
    Raises ValueError on a non-finite reward or an unknown kind (a caller bug: rewards are
    validated upstream).
    """
    n = len(rewards)
    if kind not in ("loo", "mean"):
        raise ValueError(f"unknown advantage kind {kind!r} (expected 'loo' or 'mean')")
    values = [float(r) for r in rewards]
    if not all(math.isfinite(r) for r in values):
        raise ValueError(f"non-finite reward in group: {values}")
    if n <= 1 or all(r == values[0] for r in values):
        # Exactly 0, not a rounding residue: the preprocessor's zero-advantage filter tests for it.
        return [0.0] * n
    total = math.fsum(values)
    mean = total / n
    # LOO: r_i minus the mean of the other n-1 rewards.
    loo = kind == "loo"
    advantages = [r - (total - r) / (n - 1) if loo else r - mean for r in values]
    if divide_by_std:
        std = math.sqrt(math.fsum((r - mean) ** 2 for r in values) / (n - 1))
        advantages = [a / (std + eps) for a in advantages]
    return advantages
