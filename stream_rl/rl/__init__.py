"""RL math as pure functions: no I/O, no config objects (callers pass config values by the same
names as `PreprocessorConfig` / `TrainerConfig`).

- `stream_rl.rl.advantages`: per-group advantages (pure python; no torch import).
- `stream_rl.rl.losses`: the policy loss of one micro-batch (`policy_loss`, `LossOutput`).
- `stream_rl.rl.stats`: additive importance-weight statistics (`TokenStats`, `token_stats`).
- `stream_rl.rl.logprobs`: token log-probabilities and entropies from logits.
- `stream_rl.rl.schedule`: warm-up + cosine lr factor for `LambdaLR`.

This package imports nothing itself, so the preprocessor can use advantages without torch.
"""
