"""Token log-probabilities and entropies from logits (pure torch).

The trainer recomputes the policy's log-probabilities at the *sampling temperature*
(`log_softmax(logits / T)`), so that the importance ratio against the engine's behaviour
logprobs is 1 when the weights agree. Both functions compute in float32 at least (logits of a
bf16 model are upcast first) and keep the gradient.
"""

from __future__ import annotations

import torch


def _scaled_log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score tokens, got {temperature}")
    scaled = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if temperature != 1.0:
        scaled = scaled / temperature
    return torch.log_softmax(scaled, dim=-1)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """`log softmax(logits / T)[label]` per position: logits `[..., V]`, labels `[...]` -> `[...]`.

    Positions are aligned as given: to score token t+1 from the logits at t, shift before calling.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree")
    logp = _scaled_log_softmax(logits, temperature)
    return logp.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy `-sum_v p_v log p_v` (nats) of `softmax(logits / T)` per position: `[..., V]` -> `[...]`."""
    logp = _scaled_log_softmax(logits, temperature)
    return -(logp.exp() * logp).sum(dim=-1)
