"""The policy loss of one micro-batch (pure torch). Returns a loss to MINIMISE (minus the objective).

Layout: every per-token tensor (`logp`, `behaviour_logp`, `advantages`, `mask`, and the optional
`ref_logp`, `entropy`, `truncated`, `sequence_ids`) has the same shape, either flat `[N]` (several
samples packed into one row, the trainer's layout) or `[B, T]`; the math is element-wise except
`gspo`'s per-sequence mean, which follows `sequence_ids` (each token's sequence: any integer
labels, in any layout; all of a sequence's tokens in one call, as the trainer's passes hold
whole samples), so the layout is the caller's choice. Per-sample quantities (advantage,
truncation) are broadcast to the sample's tokens by the caller. `mask` selects the trainable
tokens (completion tokens the model sampled, end-of-sequence included; prompt, padding and
environment tokens excluded). Values at unmasked positions are ignored, even if they are inf or
NaN, and get a zero gradient.

With `rho = exp(logp - behaviour_logp)`, `A` the advantage and `(eps_low, eps_high)` the clip
range (`CLIP_DEFAULTS` per loss when not given), the per-token objective is
- `reinforce` (default, PipelineRL's): `A * stopgrad(min(rho, 1 + eps_high)) * logp`, truncated
  importance sampling: the weight is capped above, never clamped below (an `eps_low` is refused),
  and carries no gradient;
- `ppo`: `min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)`, gradient through rho;
- `cispo` (MiniMax-M1, 2025): `A * stopgrad(clip(rho, 1 - eps_low, 1 + eps_high)) * logp`. The
  paper's formula clips on both sides; in practice it sets no lower bound, which is the default
  here (`eps_low=None`), and then `cispo` *is* `reinforce` with another `eps_high` (0.28 vs 0.02).
  Unlike `ppo`, no token's gradient is ever zeroed: only its weight is bounded;
- `gspo` (Zheng et al. 2025), on token t of a sequence y:
  `min(s_t * A, clip(s_t, 1 - eps_low, 1 + eps_high) * A) / |y|`, where
  `s = exp(mean over y's masked tokens of (logp - behaviour_logp))` is the length-normalised
  (geometric-mean) sequence ratio, `|y|` the number of y's masked tokens, and
  `s_t = stopgrad(s) * exp(logp_t - stopgrad(logp_t))` (the GSPO-token form, as in TRL and verl:
  the value of s, the gradient of the token's own logp times s). With one advantage per sequence
  (this project's case: advantages are per sample) the sum over y's tokens has exactly the value
  and gradient of the paper's sequence-level term `min(s * A, clip(s, 1 - eps_low, 1 + eps_high)
  * A)`: one clipped objective per sequence, a gradient of `s * A / |y|` on each of its tokens
  while unclipped, 0 on all of them once clipped; with per-token advantages it is GSPO-token. Its
  clip range is tiny (the paper's 3e-4 / 4e-4, the defaults): s is a geometric mean over tokens;
- minus `kl_coef * k3` with `k3 = e^D - D - 1`, `D = clamp(ref_logp - logp, -5, 5)` (PipelineRL's
  clamp; see `stats.k3_to_reference`), when `kl_coef > 0`;
- plus `entropy_coef * entropy` (per-token entropies computed by the caller, with gradient),
  when `entropy_coef > 0`.
For `gspo` the KL and entropy terms are divided by `|y|` like the policy term (per-sequence token
means), so `kl_coef` and `entropy_coef` weigh them against the policy term as they do for the
other losses.

`loss = -sum(objective over kept tokens) / num_sequences`, where `num_sequences` is the number of
sequences in the whole optimizer step (`TrainerConfig.samples_per_step`), not in this micro-batch:
summing the micro-batches' losses gives the step's loss. For the token-level losses each
sequence contributes its token *sum* (no per-sequence length averaging; MiniMax-M1 divides
`cispo`'s sum by the group's token count instead); for `gspo` each sequence contributes its one
objective (a token mean), so the step's loss is the paper's mean over sequences.
Overlong filtering (`overlong_filtering=True`) drops the tokens of sequences that hit max_tokens
(`truncated`, finish_reason `length`) from the sum, KL and entropy terms included, but those
sequences *still count* in `num_sequences`, as in PipelineRL: the loss scale does not depend on
how many sequences were filtered. (`gspo`'s `s` and `|y|` are over all of y's masked tokens;
`truncated` is per sequence in the trainer, so a sequence is kept or dropped whole.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from stream_rl.rl.stats import TokenStats, k3_to_reference, sequence_means, token_stats

PolicyLossKind = Literal["reinforce", "ppo", "gspo", "cispo"]
"""The losses; `TrainerConfig.policy_loss` offers the same names (a test checks)."""

CLIP_DEFAULTS: dict[str, tuple[float | None, float]] = {
    "reinforce": (None, 0.02),
    "ppo": (0.02, 0.02),
    "gspo": (3e-4, 4e-4),
    "cispo": (None, 0.28),
}
"""`(eps_low, eps_high)` of each loss when not given; `None`: no lower bound. reinforce and ppo:
this project's defaults before the other losses came; gspo: the GSPO paper's; cispo: MiniMax-M1
sets no lower bound and gives no value for its upper one (we found none), 0.28 is DAPO's
clip-higher, also the default of other CISPO implementations (e.g. Trinity-RFT)."""


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


def clip_range(kind: str, eps_low: float | None, eps_high: float | None) -> tuple[float | None, float]:
    """The `(eps_low, eps_high)` loss `kind` uses: the given values, else `CLIP_DEFAULTS[kind]`."""
    if kind not in CLIP_DEFAULTS:
        raise ValueError(f"policy_loss: unknown kind {kind!r} (expected one of {', '.join(CLIP_DEFAULTS)})")
    if kind == "reinforce" and eps_low is not None:
        raise ValueError("policy_loss: reinforce has no lower bound on its weight; eps_low must be None")
    low, high = CLIP_DEFAULTS[kind]
    return (low if eps_low is None else eps_low), (high if eps_high is None else eps_high)


def policy_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_sequences: int,
    policy_loss: PolicyLossKind = "reinforce",
    eps_low: float | None = None,
    eps_high: float | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    truncated: torch.Tensor | None = None,
    overlong_filtering: bool = False,
    sequence_ids: torch.Tensor | None = None,
) -> LossOutput:
    """Loss and statistics of one micro-batch; keyword names match `TrainerConfig`.

    `logp` carries the gradient (the trainer's log-probabilities at the sampling temperature);
    `behaviour_logp`, `advantages` and `ref_logp` are data. `eps_low`/`eps_high` default to the
    loss's `CLIP_DEFAULTS`. `truncated` (bool per token) is required when `overlong_filtering` is
    on; `ref_logp` when `kl_coef > 0`; `entropy` when `entropy_coef > 0`; `sequence_ids` for
    `gspo`. Given without a coefficient, `ref_logp`/`entropy` only feed the stats; so do
    `sequence_ids` for the token-level losses (`seq_ratio_mean`).
    """
    _check_shapes(
        logp,
        behaviour_logp=behaviour_logp,
        advantages=advantages,
        mask=mask,
        ref_logp=ref_logp,
        entropy=entropy,
        truncated=truncated,
        sequence_ids=sequence_ids,
    )
    if num_sequences < 1:
        raise ValueError(f"policy_loss: num_sequences must be >= 1, got {num_sequences}")
    low, high = clip_range(policy_loss, eps_low, eps_high)
    if policy_loss == "gspo" and sequence_ids is None:
        raise ValueError("policy_loss: gspo needs the per-token `sequence_ids` (its ratio is per sequence)")
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

    length = None
    if policy_loss in ("reinforce", "cispo"):
        floor = None if low is None else 1.0 - low
        weight = torch.clamp(torch.exp(lp.detach() - blp), min=floor, max=1.0 + high)
        objective = adv * weight * lp
    else:
        if policy_loss == "gspo" and sequence_ids is not None:
            means, counts, index = sequence_means(lp.detach() - blp, m, sequence_ids)
            length = counts.clamp(min=1.0)[index]
            # GSPO-token: the value of s, the gradient of each token's own logp (times s)
            ratio = torch.exp(means[index] + lp - lp.detach())
        else:
            ratio = torch.exp(lp - blp)
        assert low is not None  # ppo and gspo always have a lower clip
        clipped = torch.clamp(ratio, 1.0 - low, 1.0 + high)
        objective = torch.minimum(ratio * adv, clipped * adv)
    if kl_coef > 0 and ref_logp is not None:
        ref = torch.where(m, ref_logp.to(logp.dtype), zero)
        objective = objective - kl_coef * k3_to_reference(lp, ref)
    if entropy_coef > 0 and entropy is not None:
        objective = objective + entropy_coef * torch.where(m, entropy, zero)
    if length is not None:
        objective = objective / length

    loss = -torch.where(keep, objective, zero).sum() / num_sequences
    stats = token_stats(
        logp,
        behaviour_logp,
        m,
        advantages=advantages,
        policy_loss=policy_loss,
        eps_low=low,
        eps_high=high,
        ref_logp=ref_logp,
        entropy=entropy,
        filtered=(m & ~keep) if overlong_filtering else None,
        sequence_ids=sequence_ids,
    )
    return LossOutput(loss=loss, stats=stats)
