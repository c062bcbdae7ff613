"""Importance-weight and policy statistics over loss-masked tokens (pure torch, no gradient).

Everything is kept as *additive* sums in `TokenStats`, so the trainer can add the stats of its
micro-batches (`a + b`) and turn the step's total into metrics once (`.metrics()`); averages of
averages would weight micro-batches wrongly.

Definitions, over the tokens where `mask` is true (all trainable tokens, including those of
overlong-filtered sequences: the statistics describe the data, not only what the loss used),
with `rho = exp(logp - behaviour_logp)`:
- `ratio_mean` = mean rho; `ratio_max` = max rho (token ratios, whatever the loss).
- `clamp_fraction`: fraction of tokens whose weight the loss clamps, with the loss's resolved
  (eps_low, eps_high). `reinforce` and `cispo`: the IS weight is cut, rho > 1 + eps_high or (cispo
  with eps_low) rho < 1 - eps_low; the token keeps a gradient. `ppo`: the clipped branch is active
  and flat (the token's gradient is zero), (A > 0 and rho > 1 + eps_high) or
  (A < 0 and rho < 1 - eps_low). `gspo`: the same test on the *sequence* ratio s (below) instead
  of rho, so every token of a clipped sequence counts (the GSPO paper's fraction of clipped tokens).
- `seq_ratio_mean` = mean over sequences of s = exp(mean over the sequence's tokens of log rho),
  the length-normalised sequence ratio GSPO clips (when sequence ids are given; `sequences` counts
  the sequences with at least one masked token).
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
    sequences: int = 0
    seq_ratio_sum: float = 0.0

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
        if self.sequences:
            out["seq_ratio_mean"] = self.seq_ratio_sum / self.sequences
        return out


def k3_to_reference(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 `e^D - D - 1`, `D = clamp(ref_logp - logp, -5, 5)`; differentiable in `logp`.

    The clamp (as in PipelineRL) bounds e^D, and also zeroes the gradient where |D| > 5.
    """
    delta = torch.clamp(ref_logp - logp, -KL_CLAMP, KL_CLAMP)
    return torch.exp(delta) - delta - 1.0


def sequence_means(
    values: torch.Tensor, mask: torch.Tensor, sequence_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence mean of `values` over its masked tokens, for any layout.

    `sequence_ids` (integers, the shape of `values`) names each token's sequence; a sequence's
    tokens need not be contiguous. Returns `(means [S], counts [S], index)`: for the S distinct
    ids in sorted order, the mean over masked tokens (0 for a sequence without any) and the
    number of masked tokens, and `index` (the shape of `values`) maps each token to its sequence,
    so `means[index]` broadcasts back. Values at unmasked positions must be finite (zero them
    first). Differentiable in `values` (the trainer passes detached ones).
    """
    ids, index = torch.unique(sequence_ids, return_inverse=True)
    flat = index.reshape(-1)
    m = mask.reshape(-1).to(values.dtype)
    sums = torch.zeros(len(ids), dtype=values.dtype, device=values.device)
    counts = torch.zeros(len(ids), dtype=values.dtype, device=values.device)
    sums = sums.index_add(0, flat, values.reshape(-1) * m)
    counts = counts.index_add(0, flat, m)
    return sums / counts.clamp(min=1.0), counts, index


@torch.no_grad()
def token_stats(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    advantages: torch.Tensor | None = None,
    policy_loss: str = "reinforce",
    eps_low: float | None = 0.02,
    eps_high: float = 0.02,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    filtered: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
) -> TokenStats:
    """Statistics of one micro-batch; all tensors share one shape (flat `[N]` or `[B, T]`).

    `eps_low`/`eps_high` are the loss's resolved clip range (`eps_low=None`: no lower bound).
    `advantages` is needed for the `ppo` and `gspo` clamp fractions, `sequence_ids` (each token's
    sequence, as in `sequence_means`) for `gspo`'s and for `seq_ratio_mean`; `filtered` marks
    tokens whose sequence the loss drops (overlong filtering).
    """
    m = mask.bool()
    n = int(m.sum().item())
    stats = TokenStats(tokens=n)
    if n == 0:
        return stats
    lp = logp.detach()[m].double()
    log_ratio = lp - behaviour_logp.detach()[m].double()
    rho = torch.exp(log_ratio)
    seq_ratio = None
    if sequence_ids is not None:
        means, _, index = sequence_means(log_ratio, torch.ones_like(log_ratio), sequence_ids[m])
        seq_ratio = torch.exp(means)  # every sequence here has a masked token
    if policy_loss in ("ppo", "gspo"):
        if advantages is None:
            raise ValueError(f"token_stats: the {policy_loss} clamp fraction needs the advantages")
        if policy_loss == "gspo" and seq_ratio is None:
            raise ValueError("token_stats: the gspo clamp fraction needs the sequence ids")
        adv = advantages.detach()[m].double()
        r = seq_ratio[index] if seq_ratio is not None and policy_loss == "gspo" else rho
        low = -math.inf if eps_low is None else 1 - eps_low
        clamped = ((adv > 0) & (r > 1 + eps_high)) | ((adv < 0) & (r < low))
    else:
        clamped = rho > 1 + eps_high
        if policy_loss == "cispo" and eps_low is not None:  # reinforce's weight has no lower bound
            clamped |= rho < 1 - eps_low
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
    if seq_ratio is not None:
        sums.append(seq_ratio.sum())
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
    if seq_ratio is not None:
        stats.seq_ratio_sum, stats.sequences = rest.pop(0), len(seq_ratio)
    return stats
