"""Builders for trainer tests and benchmarks: a tiny random causal LM on disk and synthetic
training batches (not used by the stages)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fakes.records import f32

from stream_rl.config import RunConfig
from stream_rl.contracts import TrainingBatch, TrainingSample, Verdict, VersionSpan
from stream_rl.errors import WeightSyncError
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.topics import TRAINING_BATCHES, TopicNames
from stream_rl.kafka.transport import Transport


def make_tiny_model(
    out: str | Path,
    *,
    vocab_size: int = 64,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    tie_embeddings: bool = True,
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
        tie_word_embeddings=tie_embeddings,
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


def stage_config(tmp: Path, model_dir: Path, run: str = "r1", **trainer: object) -> RunConfig:
    """A run config for trainer tests: runs under `tmp/runs`, no inference servers, small steps."""
    return RunConfig.model_validate(
        {
            "run": run,
            "runs_dir": str(Path(tmp) / "runs"),
            "model": {"path": str(model_dir)},
            "inference": {"num_servers": 0},
            "trainer": {"samples_per_step": 4, "lr": 1e-3, "max_steps": 100, **trainer},
        }
    )


def produce_batches(
    transport: Transport, names: TopicNames, batches: Sequence[TrainingBatch | bytes]
) -> None:
    """Write micro-batches (or raw bytes, to test the DLQ) to the run's `training-batches`."""
    serde = default_serde()
    producer = transport.producer("test-batches")
    for b in batches:
        value = b if isinstance(b, bytes) else serde.encode(b)
        producer.produce(names.topic(TRAINING_BATCHES), value, key="k")
    producer.flush()
    producer.close()


def setup_topics(transport: Transport, run: str, batches: Sequence[TrainingBatch | bytes]) -> TopicNames:
    """Create a run's topics (in-memory transport: `create_topics`) and write `batches`."""
    names = TopicNames(run=run)
    transport.create_topics(names.all_topics())
    produce_batches(transport, names, batches)
    return names


@dataclass
class FakeReport:
    version: int
    broadcast_ms: float
    updated: list[str]
    failed: dict[str, str] = field(default_factory=dict)
    per_server: dict[str, dict[str, float]] = field(default_factory=dict)


class FakePusher:
    """A hand-written stand-in for `WeightSender`: records (version, checksum) of each push; can
    drop a server at a version (`drop_at`) or fail like a crash (`crash_at`)."""

    def __init__(self, crash_at: int | None = None, drop_at: int | None = None) -> None:
        self.urls = ["http://a:1", "http://b:2"]
        self.live: list[str] = []
        self.pushed: list[tuple[int, str]] = []
        self.crash_at = crash_at
        self.drop_at = drop_at
        self.closed = False

    @property
    def live_servers(self) -> list[str]:
        return list(self.live)

    def connect(self) -> dict[str, str]:
        self.live = list(self.urls)
        return {}

    def push(self, version: int, named_tensors: Sequence[tuple[str, Any]], bucket_bytes: int) -> FakeReport:
        from stream_rl.weights.checksum import weights_checksum

        if version == self.crash_at:
            raise WeightSyncError("simulated crash")
        self.pushed.append((version, weights_checksum(named_tensors)))
        failed = {}
        if version == self.drop_at and "http://b:2" in self.live:
            self.live.remove("http://b:2")
            failed["http://b:2"] = "timed out"
        return FakeReport(version, 1.5, list(self.live), failed)

    def add(self, server: Any) -> None:
        """A server that joined the run (`stream_rl.train.push.add_server`); live after `connect()`."""
        self.urls.append(server.url)

    def forget(self, url: str) -> bool:
        known = url in self.urls
        self.urls = [u for u in self.urls if u != url]
        self.live = [u for u in self.live if u != url]
        return known

    def drop(self, url: str) -> bool:
        live = url in self.live
        self.live = [u for u in self.live if u != url]
        return live

    def close(self) -> None:
        self.closed = True
