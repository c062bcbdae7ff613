"""Builders for trainer tests and benchmarks: a tiny random causal LM on disk and synthetic
training batches (not used by the stages)."""

from __future__ import annotations

import random
from pathlib import Path

from stream_rl.contracts import TrainingBatch, TrainingSample, Verdict, VersionSpan
from stream_rl.testing import f32


def make_tiny_model(
    out: str | Path,
    *,
    vocab_size: int = 64,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
) -> Path:
    """A random-init Qwen2 causal LM saved with `save_pretrained` (safetensors); returns `out`."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(str(out))
    return Path(out)


def make_sample(
    rng: random.Random,
    *,
    key: str,
    vocab_size: int = 64,
    prompt_len: tuple[int, int] = (4, 12),
    completion_len: tuple[int, int] = (4, 24),
    advantage: float | None = None,
    version: int = 0,
    finish_reason: str = "stop",
) -> TrainingSample:
    """A random sample; the last completion token is masked out one time in four (like padding
    after EOS would be), the rest trainable."""
    p = rng.randint(*prompt_len)
    c = rng.randint(*completion_len)
    adv = f32(rng.uniform(-1, 1)) if advantage is None else f32(advantage)
    mask = [True] * c
    if c > 1 and rng.random() < 0.25:
        mask[-1] = False
    return TrainingSample(
        rollout_id=f"{key}.s0",
        group_id=key,
        input_ids=[rng.randrange(vocab_size) for _ in range(p + c)],
        prompt_len=p,
        loss_mask=mask,
        advantages=[adv] * c,
        behaviour_logprobs=[f32(-rng.uniform(2.0, 6.0)) for _ in range(c)],
        version_spans=[VersionSpan(version, 0)],
        reward=1.0 if adv > 0 else 0.0,
        verdict=Verdict.CORRECT if adv > 0 else Verdict.WRONG,
        finish_reason=finish_reason,
    )


def make_batches(
    n_batches: int,
    samples_per_batch: int,
    *,
    seed: int = 0,
    run_id: str = "test",
    vocab_size: int = 64,
    version: int = 0,
    filtered_every: int = 0,
) -> list[TrainingBatch]:
    """Deterministic synthetic micro-batches. With `filtered_every=k`, every k-th batch also
    reports one filtered (zero-advantage) sample."""
    rng = random.Random(seed)
    out = []
    for b in range(n_batches):
        samples = [
            make_sample(rng, key=f"b{b}.g{i}", vocab_size=vocab_size, version=version)
            for i in range(samples_per_batch)
        ]
        filtered = 1 if filtered_every and (b + 1) % filtered_every == 0 else 0
        out.append(
            TrainingBatch(
                batch_id=f"batch-{b:05d}",
                run_id=run_id,
                samples=samples,
                producer_id="synthetic",
                created_ms=1_700_000_000_000 + b,
                num_filtered=filtered,
            )
        )
    return out
