"""Token sampling for a batch of sequences with per-row parameters.

Contract (what the trainer relies on):
- A row with temperature T > 0 draws from exactly `softmax(logits / T)` when top_k = 0 and
  top_p = 1 (the defaults), via the Gumbel-max trick on float64 uniforms.
- The reported logprob is always `log_softmax(logits / T)` of the *full* distribution at the
  sampled id. With top_k > 0 or top_p < 1 the draw comes from the renormalised truncated
  distribution, so the reported logprob is then *not* the behaviour probability (it is lower
  by log of the kept mass): keep the defaults for RL.
- Temperature 0 is greedy (argmax); its logprob is `log_softmax(logits)` (T = 1).
- Rows with a seed draw their uniforms from their own `torch.Generator`, so a seeded request
  gives the same tokens whatever else shares the batch; other rows share the engine's generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BatchSampling:
    """Per-row sampling parameters of one decode step (tensors on the logits' device)."""

    temperature: torch.Tensor  # [B] float; 0 = greedy
    top_k: torch.Tensor | None  # [B] long, 0 = off; None when no row uses top-k
    top_p: torch.Tensor | None  # [B] float, 1 = off; None when no row uses top-p
    generators: list[torch.Generator | None]  # per row; None: use the shared generator
    any_sampled: bool  # at least one row has T > 0
    top_logprobs: int = 0  # how many top alternatives to return per row (max over rows)


@dataclass
class Sampled:
    tokens: torch.Tensor  # [B] long
    logprobs: torch.Tensor  # [B] float32
    top_ids: torch.Tensor | None  # [B, k] long when top_logprobs > 0
    top_logprobs: torch.Tensor | None  # [B, k] float32


def truncation_mask(
    logp: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Boolean mask [B, V] of the ids that top-k / top-p remove (True = removed).

    top_k keeps the k most likely ids (0 = all). top_p keeps the smallest most-likely set whose
    mass reaches top_p (the most likely id is always kept; rows with top_p >= 1 keep everything).
    """
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    vocab = logp.shape[-1]
    remove_sorted = torch.zeros_like(sorted_logp, dtype=torch.bool)
    ranks = torch.arange(vocab, device=logp.device)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
        remove_sorted |= ranks[None, :] >= k[:, None]
    if top_p is not None:
        probs = sorted_logp.exp()
        mass_before = probs.cumsum(dim=-1) - probs
        remove_sorted |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    remove_sorted[:, 0] = False
    return torch.zeros_like(remove_sorted).scatter(1, order, remove_sorted)


def sample(logits: torch.Tensor, params: BatchSampling, shared: torch.Generator | None = None) -> Sampled:
    """Sample one token per row of `logits` [B, V]; see the module docstring for the contract."""
    logits = logits.float()
    temperature = params.temperature
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)
    logp = torch.log_softmax(logits / scale[:, None], dim=-1)
    if params.any_sampled:
        scores = logp
        if params.top_k is not None or params.top_p is not None:
            scores = logp.masked_fill(truncation_mask(logp, params.top_k, params.top_p), float("-inf"))
        uniforms = torch.rand(logp.shape, dtype=torch.float64, device=logp.device, generator=shared)
        for row, generator in enumerate(params.generators):
            if generator is not None:
                torch.rand(
                    logp.shape[-1],
                    dtype=torch.float64,
                    device=logp.device,
                    generator=generator,
                    out=uniforms[row],
                )
        gumbel = -torch.log(-torch.log(uniforms))
        perturbed = torch.where(greedy[:, None], logp.double(), scores.double() + gumbel)
        tokens = perturbed.argmax(dim=-1)
    else:
        tokens = logp.argmax(dim=-1)
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    top_ids = top_values = None
    if params.top_logprobs > 0:
        top_values, top_ids = logp.topk(min(params.top_logprobs, logp.shape[-1]), dim=-1)
    return Sampled(tokens=tokens, logprobs=chosen, top_ids=top_ids, top_logprobs=top_values)
