"""Prometheus metrics of the trainer (served on `/metrics` with `trainer.metrics_port`).

`stream_rl_trainer_step{metric=...}` mirrors the latest `WeightVersion.metrics` (loss, grad_norm,
lr, reward_mean, version_lag_*, ratio_*, ess, entropy, tokens_per_s, step_s, broadcast_ms, ...);
the counters and the per-sample version-lag histogram accumulate over the process's life.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import Counter, Gauge, Histogram

VERSION = Gauge("stream_rl_trainer_version", "Weight version the trainer holds")
STEP = Gauge("stream_rl_trainer_step", "Numbers of the latest optimizer step", ["metric"])
SAMPLES = Counter("stream_rl_trainer_samples", "Samples trained")
FILTERED = Counter("stream_rl_trainer_samples_filtered", "Samples consumed without training (filtered)")
TOKENS = Counter("stream_rl_trainer_tokens", "Tokens (prompt + completion) trained")
VERSION_LAG = Histogram(
    "stream_rl_trainer_version_lag",
    "Per trained sample: trainer version - oldest version that sampled it",
    buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
)
SERVER_FAILURES = Counter("stream_rl_trainer_server_failures", "Servers dropped by a weight push")
SERVERS_RESTARTED = Counter(
    "stream_rl_trainer_servers_restarted",
    "Live servers found holding an older version than pushed them (restarted): dropped, re-joined, re-pushed",
)
SERVERS_JOINED = Counter(
    "stream_rl_trainer_servers_joined",
    "Servers that joined the run (topic servers) and were pushed the current version",
)
CHECKSUM_MISMATCH = Counter(
    "stream_rl_trainer_checksum_mismatch", "Re-trained versions whose checksum differs from the lineage"
)
CHECKPOINTS = Counter("stream_rl_trainer_checkpoints", "Checkpoints written")
SKIPPED_STEPS = Counter("stream_rl_trainer_skipped_steps", "Steps not applied: the gradient was not finite")
DUPLICATES = Counter("stream_rl_trainer_duplicates", "Samples dropped: their id was trained before")
NONFINITE = Counter("stream_rl_trainer_nonfinite_micro_batches", "Micro-batches whose loss was not finite")
EVAL_HOLD_SECONDS = Counter(
    "stream_rl_trainer_eval_hold_seconds", "Seconds pushes were held for evaluations (eval.pin)"
)


def observe_step(version: int, metrics: Mapping[str, float], lags: Iterable[int]) -> None:
    VERSION.set(version)
    for name, value in metrics.items():
        STEP.labels(name).set(value)
    SAMPLES.inc(metrics.get("samples", 0.0))
    FILTERED.inc(metrics.get("samples_filtered", 0.0))
    TOKENS.inc(metrics.get("tokens_trained", 0.0))
    DUPLICATES.inc(metrics.get("duplicates", 0.0))
    NONFINITE.inc(metrics.get("nonfinite_micro_batches", 0.0))
    for lag in lags:
        VERSION_LAG.observe(lag)
