"""Importance-weight and policy statistics over loss-masked tokens (pure torch, no gradient).

Everything is kept as *additive* sums in `TokenStats`, so the trainer can add the stats of its
micro-batches (`a + b`) and turn the step's total into metrics once (`.metrics()`); averages of
averages would weight micro-batches wrongly.

Definitions, over the tokens where `mask` is true (all trainable tokens, including those of
overlong-filtered sequences: the statistics describe the data, not only what the loss used),
with `rho = exp(logp - behaviour_logp)`:
- `ratio_mean` = mean rho; `ratio_max` = max rho.
- `clamp_fraction`: fraction of tokens whose weight the loss clamps. `reinforce`: rho > 1 + eps_high
  (the truncated IS weight is cut). `ppo`: the clipped branch is active and flat, i.e.
  (A > 0 and rho > 1 + eps_high) or (A < 0 and rho < 1 - eps_low).
- `ess` = (sum rho)^2 / (n * sum rho^2), in (0, 1]: token-level effective sample size fraction
  (PipelineRL's `rl/ess`); 1 when on-policy.
- `kl_new_old` = mean of k3 = rho - 1 - log rho >= 0: the unbiased, non-negative estimate of
  KL(behaviour || new) from tokens sampled by the behaviour policy.
- `mean_abs_log_ratio` = mean |log rho|.
- `entropy` = mean of the given per-token entropies (when given).
- `kl_ref` = mean of the loss's k3 to the reference, `e^D - D - 1` with
  `D = clamp(ref_logp - logp, -5, 5)` (when reference logprobs are given).
- `tokens`, `filtered_tokens` (masked tokens of overlong-filtered sequences).
Metrics that are undefined for zero tokens are left out of `.metrics()`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

KL_CLAMP = 5.0
"""Bound of the log-ratio inside the k3 KL to the reference (as PipelineRL): keeps e^D finite."""


@dataclass
class TokenStats:
    """Additive sums over masked tokens; see the module docstring for the metrics they give."""

    tokens: int = 0
    filtered_tokens: int = 0
    clamped: int = 0
    ratio_sum: float = 0.0
    ratio_sq_sum: float = 0.0
    ratio_max: float = -math.inf
    k3_new_old_sum: float = 0.0
    abs_log_ratio_sum: float = 0.0
    entropy_sum: float = 0.0
    entropy_tokens: int = 0
    kl_ref_sum: float = 0.0
    kl_ref_tokens: int = 0

    def __add__(self, other: TokenStats) -> TokenStats:
        out = TokenStats()
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            setattr(out, f.name, max(a, b) if f.name == "ratio_max" else a + b)
        return out

    def metrics(self) -> dict[str, float]:
        """Named metrics (floats) for logs, Prometheus and `WeightVersion.metrics`."""
        out: dict[str, float] = {"tokens": float(self.tokens), "filtered_tokens": float(self.filtered_tokens)}
        if self.tokens:
            n = self.tokens
            out["ratio_mean"] = self.ratio_sum / n
            out["ratio_max"] = self.ratio_max
            out["clamp_fraction"] = self.clamped / n
            out["ess"] = self.ratio_sum**2 / (n * self.ratio_sq_sum) if self.ratio_sq_sum > 0 else 0.0
            out["kl_new_old"] = self.k3_new_old_sum / n
            out["mean_abs_log_ratio"] = self.abs_log_ratio_sum / n
        if self.entropy_tokens:
            out["entropy"] = self.entropy_sum / self.entropy_tokens
        if self.kl_ref_tokens:
            out["kl_ref"] = self.kl_ref_sum / self.kl_ref_tokens
        return out


def k3_to_reference(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 `e^D - D - 1`, `D = clamp(ref_logp - logp, -5, 5)`; differentiable in `logp`.

    The clamp (as in PipelineRL) bounds e^D, and also zeroes the gradient where |D| > 5.
    """
    delta = torch.clamp(ref_logp - logp, -KL_CLAMP, KL_CLAMP)
    return torch.exp(delta) - delta - 1.0


@torch.no_grad()
def token_stats(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    advantages: torch.Tensor | None = None,
    policy_loss: str = "reinforce",
    eps_low: float = 0.02,
    eps_high: float = 0.02,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    filtered: torch.Tensor | None = None,
) -> TokenStats:
    """Statistics of one micro-batch; all tensors share one shape (flat `[N]` or `[B, T]`).

    `advantages` is needed for the `ppo` clamp fraction; `filtered` marks tokens whose sequence
    the loss drops (overlong filtering).
    """
    m = mask.bool()
    n = int(m.sum().item())
    stats = TokenStats(tokens=n)
    if n == 0:
        return stats
    lp = logp.detach()[m].double()
    log_ratio = lp - behaviour_logp.detach()[m].double()
    rho = torch.exp(log_ratio)
    if policy_loss == "ppo":
        if advantages is None:
            raise ValueError("token_stats: the ppo clamp fraction needs the advantages")
        adv = advantages.detach()[m].double()
        clamped = ((adv > 0) & (rho > 1 + eps_high)) | ((adv < 0) & (rho < 1 - eps_low))
    else:
        clamped = rho > 1 + eps_high
    sums = [
        clamped.sum().double(),
        rho.sum(),
        (rho * rho).sum(),
        rho.max(),
        (rho - 1.0 - log_ratio).sum(),
        log_ratio.abs().sum(),
    ]
    if entropy is not None:
        sums.append(entropy.detach()[m].double().sum())
    if ref_logp is not None:
        sums.append(k3_to_reference(lp, ref_logp.detach()[m].double()).sum())
    if filtered is not None:
        sums.append((filtered.bool() & m).sum().double())
    values = torch.stack(sums).tolist()  # one device sync for the whole micro-batch
    stats.clamped = int(values[0])
    stats.ratio_sum, stats.ratio_sq_sum, stats.ratio_max = values[1], values[2], values[3]
    stats.k3_new_old_sum, stats.abs_log_ratio_sum = values[4], values[5]
    rest = values[6:]
    if entropy is not None:
        stats.entropy_sum, stats.entropy_tokens = rest.pop(0), n
    if ref_logp is not None:
        stats.kl_ref_sum, stats.kl_ref_tokens = rest.pop(0), n
    if filtered is not None:
        stats.filtered_tokens = int(rest.pop(0))
    return stats
