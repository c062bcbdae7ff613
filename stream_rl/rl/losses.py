"""The policy loss of one micro-batch (pure torch). Returns a loss to MINIMISE (minus the objective).

Layout: every per-token tensor (`logp`, `behaviour_logp`, `advantages`, `mask`, and the optional
`ref_logp`, `entropy`, `truncated`) has the same shape, either flat `[N]` (several samples packed
into one row, the trainer's layout) or `[B, T]`; the math is element-wise, so the layout is the
caller's choice. Per-sample quantities (advantage, truncation) are broadcast to the sample's
tokens by the caller. `mask` selects the trainable tokens (completion tokens the model sampled,
end-of-sequence included; prompt, padding and environment tokens excluded). Values at
unmasked positions are ignored, even if they are inf or NaN, and get a zero gradient.

With `rho = exp(logp - behaviour_logp)` and `A` the advantage, the per-token objective is
- `reinforce` (default, PipelineRL's): `A * stopgrad(min(rho, 1 + eps_high)) * logp`, truncated
  importance sampling: the weight is capped above, never clamped below, and carries no gradient;
- `ppo`: `min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)`, gradient through rho;
- minus `kl_coef * k3` with `k3 = e^D - D - 1`, `D = clamp(ref_logp - logp, -5, 5)` (PipelineRL's
  clamp; see `stats.k3_to_reference`), when `kl_coef > 0`;
- plus `entropy_coef * entropy` (per-token entropies computed by the caller, with gradient),
  when `entropy_coef > 0`.

`loss = -sum(objective over kept tokens) / num_sequences`, where `num_sequences` is the number of
sequences in the whole optimizer step (`TrainerConfig.samples_per_step`), not in this micro-batch:
summing the micro-batches' losses gives the step's loss, with no per-sequence length averaging.
Overlong filtering (`overlong_filtering=True`) drops the tokens of sequences that hit max_tokens
(`truncated`, finish_reason `length`) from the sum, KL and entropy terms included, but those
sequences *still count* in `num_sequences`, as in PipelineRL: the loss scale does not depend on
how many sequences were filtered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from stream_rl.rl.stats import TokenStats, k3_to_reference, token_stats

PolicyLossKind = Literal["reinforce", "ppo"]


@dataclass
class LossOutput:
    loss: torch.Tensor
    """Scalar to minimise (call `.backward()` on it)."""
    stats: TokenStats
    """Additive statistics of this micro-batch (see `stream_rl.rl.stats`)."""


def _check_shapes(reference: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.shape != reference.shape:
            raise ValueError(f"policy_loss: {name} has shape {tuple(t.shape)}, logp {tuple(reference.shape)}")


def policy_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_sequences: int,
    policy_loss: PolicyLossKind = "reinforce",
    eps_low: float = 0.02,
    eps_high: float = 0.02,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    truncated: torch.Tensor | None = None,
    overlong_filtering: bool = False,
) -> LossOutput:
    """Loss and statistics of one micro-batch; keyword names match `TrainerConfig`.

    `logp` carries the gradient (the trainer's log-probabilities at the sampling temperature);
    `behaviour_logp`, `advantages` and `ref_logp` are data. `truncated` (bool per token) is
    required when `overlong_filtering` is on; `ref_logp` when `kl_coef > 0`; `entropy` when
    `entropy_coef > 0`. Given without a coefficient, `ref_logp`/`entropy` only feed the stats.
    """
    _check_shapes(
        logp,
        behaviour_logp=behaviour_logp,
        advantages=advantages,
        mask=mask,
        ref_logp=ref_logp,
        entropy=entropy,
        truncated=truncated,
    )
    if num_sequences < 1:
        raise ValueError(f"policy_loss: num_sequences must be >= 1, got {num_sequences}")
    if policy_loss not in ("reinforce", "ppo"):
        raise ValueError(f"policy_loss: unknown kind {policy_loss!r} (expected 'reinforce' or 'ppo')")
    if kl_coef > 0 and ref_logp is None:
        raise ValueError("policy_loss: kl_coef > 0 needs ref_logp (reference-model logprobs)")
    if entropy_coef > 0 and entropy is None:
        raise ValueError("policy_loss: entropy_coef > 0 needs the per-token entropy")
    if overlong_filtering and truncated is None:
        raise ValueError("policy_loss: overlong_filtering needs the per-token `truncated` flags")

    m = mask.bool()
    keep = m & ~truncated.bool() if overlong_filtering and truncated is not None else m
    # Neutralise unmasked positions *before* any arithmetic, so inf/NaN there (padding) can
    # neither leak into the sum nor into the gradient (torch.where alone would give 0 * inf).
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    lp = torch.where(m, logp, zero)
    blp = torch.where(m, behaviour_logp.to(logp.dtype), zero)
    adv = torch.where(m, advantages.to(logp.dtype), zero)

    if policy_loss == "reinforce":
        weight = torch.clamp(torch.exp(lp.detach() - blp), max=1.0 + eps_high)
        objective = adv * weight * lp
    else:
        ratio = torch.exp(lp - blp)
        clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
        objective = torch.minimum(ratio * adv, clipped * adv)
    if kl_coef > 0 and ref_logp is not None:
        ref = torch.where(m, ref_logp.to(logp.dtype), zero)
        objective = objective - kl_coef * k3_to_reference(lp, ref)
    if entropy_coef > 0 and entropy is not None:
        objective = objective + entropy_coef * torch.where(m, entropy, zero)

    loss = -torch.where(keep, objective, zero).sum() / num_sequences
    stats = token_stats(
        logp,
        behaviour_logp,
        m,
        advantages=advantages,
        policy_loss=policy_loss,
        eps_low=eps_low,
        eps_high=eps_high,
        ref_logp=ref_logp,
        entropy=entropy,
        filtered=(m & ~keep) if overlong_filtering else None,
    )
    return LossOutput(loss=loss, stats=stats)
