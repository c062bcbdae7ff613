"""One optimizer step's worth of micro-batches: training them and accounting for them.

`StepRunner.add(batch, version)` trains a micro-batch's samples (forward/backward, gradients
accumulate) and counts it; `consumed` (samples trained + filtered) tells the caller when the
step is full; `finish()` takes the optimizer step and returns the step's numbers. The trainer
stage and `replay trainer` both cut steps with it, so a replay trains exactly what the run did.

Duplicates (`stream_rl.train.dedupe`): a sample id trains at most once; `add()` drops what the
trainer already trained before anything is counted. Non-finite numbers: a micro-batch whose loss
is not finite is not back-propagated (`nonfinite_micro_batches`), and a step whose gradient norm
is not finite is skipped (`skipped_step`: weights and optimizer untouched, the schedule advances);
both are counted in the step's metrics, so they reach `WeightVersion.metrics` and the summary.

Version lag of a sample: the version of the weights that score it (the trainer's current
version) minus the oldest version that sampled any of its tokens (`version_lag_*`), minus the
version that sampled its last token (`version_lag_last_*`: with in-flight updates a long
sample's tokens come from successive versions), and minus each token's version, averaged over
tokens (`version_lag_token_mean`). `version_lag_n<k>` counts the step's samples at lag k (from
the oldest span; `version_lag_n16` counts 16 and more), so the per-sample distribution of a run
is the sum over its versions.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from stream_rl.contracts import TrainingBatch, TrainingSample, token_versions
from stream_rl.kafka.transport import TopicPartition
from stream_rl.rl.stats import TokenStats
from stream_rl.train.dedupe import TrainedIds
from stream_rl.train.step import StepOutcome, TrainerBackend

LAG_HISTOGRAM_MAX = 16
"""`version_lag_n16` counts the samples at lag 16 or more."""


@dataclass
class StepAccumulator:
    samples_trained: int = 0
    samples_filtered: int = 0
    tokens: int = 0
    """Tokens (prompt + completion) of the trained samples."""
    micro_batches: int = 0
    loss_sum: float = 0.0
    stats: TokenStats = field(default_factory=TokenStats)
    reward_sum: float = 0.0
    lags: list[int] = field(default_factory=list)
    """Per trained sample: version - min sampling version."""
    last_lags: list[int] = field(default_factory=list)
    """Per trained sample: version - the version that sampled its last token."""
    lag_token_sum: int = 0
    lag_tokens: int = 0
    over_lag_bound: int = 0
    """Trained samples whose lag exceeds the run's bound (`StepRunner.lag_bound`): trained with
    their true lag, never silently."""
    real_tokens: int = 0
    padded_tokens: int = 0
    compute_s: float = 0.0
    duplicates: int = 0
    """Samples dropped because their id was trained before (never trained, never consumed)."""
    nonfinite_micro_batches: int = 0
    """Trained groups of samples whose loss was not finite (not back-propagated)."""
    offsets: dict[TopicPartition, int] = field(default_factory=dict)
    """Next offsets to consume after this step's records (decoded or sent to the DLQ)."""
    consumed_by_partition: dict[int, int] = field(default_factory=dict)
    """`consumed` by the problems partition of the samples (-1: not known): admission's per-partition R."""
    started: float = field(default_factory=time.monotonic)

    @property
    def consumed(self) -> int:
        """Samples taken off the stream in this step: trained or filtered by the preprocessor."""
        return self.samples_trained + self.samples_filtered


def sample_lag(sample: TrainingSample, version: int) -> tuple[int, int, int] | None:
    """(lag from the oldest span, sum of per-token lags, tokens), None for an empty completion."""
    if not sample.version_spans or sample.completion_len == 0:
        return None
    versions = token_versions(sample.version_spans, sample.completion_len)
    oldest = min(sp.version for sp in sample.version_spans)
    return version - oldest, sum(version - v for v in versions), len(versions)


def unusable_reason(batch: TrainingBatch, vocab_size: int) -> str | None:
    """Why a decoded batch cannot be trained (it goes to the DLQ), or None."""
    for s in batch.samples:
        if s.input_ids and (max(s.input_ids) >= vocab_size or min(s.input_ids) < 0):
            return f"sample {s.rollout_id}: token id outside the model's vocabulary of {vocab_size}"
    return None


@dataclass
class StepSummary:
    acc: StepAccumulator
    outcome: StepOutcome
    metrics: dict[str, float]


class StepRunner:
    """Accumulates micro-batches into one optimizer step of a `TrainerBackend`.

    Samples are buffered across micro-batches and trained (forward + backward) once
    `flush_tokens` of them are pending, and at the end of the step: small micro-batches (which
    keep steps close to `samples_per_step`) then cost no extra forward passes. The buffering is
    deterministic, so a replay trains exactly the same rows."""

    def __init__(
        self,
        trainer: TrainerBackend,
        flush_tokens: int = 512,
        trained: TrainedIds | None = None,
        lag_bound: int | None = None,
    ) -> None:
        """`trained`: the ids already trained (a sample id trains at most once); `lag_bound`: the
        run's staleness bound (`actor.max_lag`, 0 in conventional mode): samples trained beyond it
        are counted (`samples_over_lag_bound`)."""
        self.trainer = trainer
        self.flush_tokens = flush_tokens
        self.trained = trained if trained is not None else TrainedIds()
        self.lag_bound = lag_bound
        self.acc = StepAccumulator()
        self._pending: list[TrainingSample] = []
        self._pending_tokens = 0

    def add(self, batch: TrainingBatch, version: int) -> list[int]:
        """Account for the batch's samples (trained at weights `version`); returns their version lags.
        Samples trained before are dropped first (counted in `duplicates`)."""
        acc = self.acc
        kept, dropped = self.trained.filter(batch)
        acc.duplicates += dropped
        if kept is None:
            return []
        batch = kept
        acc.samples_filtered += batch.num_filtered
        by = acc.consumed_by_partition
        filtered = batch.filtered_by_partition or ({-1: batch.num_filtered} if batch.num_filtered else {})
        for p, n in filtered.items():
            by[p] = by.get(p, 0) + n
        for sample in batch.samples:
            by[sample.problem_partition] = by.get(sample.problem_partition, 0) + 1
        if not batch.samples:
            return []
        acc.micro_batches += 1
        acc.samples_trained += len(batch.samples)
        acc.tokens += batch.num_tokens
        lags = []
        for s in batch.samples:
            acc.reward_sum += s.reward
            lag = sample_lag(s, version)
            if lag is not None:
                lags.append(lag[0])
                acc.last_lags.append(version - s.version_spans[-1].version)
                acc.lag_token_sum += lag[1]
                acc.lag_tokens += lag[2]
                if self.lag_bound is not None and lag[0] > self.lag_bound:
                    acc.over_lag_bound += 1
        acc.lags.extend(lags)
        self._pending.extend(batch.samples)
        self._pending_tokens += batch.num_tokens
        if self._pending_tokens >= self.flush_tokens:
            self._train_pending()
        return lags

    def _train_pending(self) -> None:
        if not self._pending:
            return
        acc = self.acc
        started = time.perf_counter()
        result = self.trainer.micro_batch(self._pending)
        acc.compute_s += time.perf_counter() - started
        self._pending = []
        self._pending_tokens = 0
        if not result.finite:
            acc.nonfinite_micro_batches += 1  # what it returns is from its finite passes only
        acc.loss_sum += result.loss
        acc.stats = acc.stats + result.stats
        acc.real_tokens += result.real_tokens
        acc.padded_tokens += result.padded_tokens

    def note_offset(self, tp: TopicPartition, next_offset: int) -> None:
        self.acc.offsets[tp] = next_offset

    def finish(self) -> StepSummary:
        """The optimizer step over what was added; starts a new accumulation."""
        self._train_pending()
        acc = self.acc
        started = time.perf_counter()
        outcome = self.trainer.optimizer_step(acc.samples_trained)
        acc.compute_s += time.perf_counter() - started
        self.trained.step_taken()
        if outcome.stats is not None:  # a backend that trains at step time (DeepSpeed)
            acc.stats = outcome.stats
            acc.loss_sum = outcome.loss_sum or 0.0
        self.acc = StepAccumulator()
        return StepSummary(acc=acc, outcome=outcome, metrics=step_metrics(acc, outcome))


def step_metrics(acc: StepAccumulator, outcome: StepOutcome) -> dict[str, float]:
    """The step's numbers for `WeightVersion.metrics` and Prometheus (timings added by the stage)."""
    n = acc.samples_trained
    out: dict[str, float] = {
        "samples": float(n),
        "samples_filtered": float(acc.samples_filtered),
        "micro_batches": float(acc.micro_batches),
        "tokens_trained": float(acc.tokens),
        "lr": outcome.lr,
        "compute_s": acc.compute_s,
        "tokens_per_s": acc.tokens / acc.compute_s if acc.compute_s > 0 else 0.0,
    }
    if outcome.skipped:
        out["skipped_step"] = 1.0  # the gradient was not finite: nothing applied
    else:
        out["grad_norm"] = outcome.grad_norm
    if acc.duplicates:
        out["duplicates"] = float(acc.duplicates)
    if acc.nonfinite_micro_batches:
        out["nonfinite_micro_batches"] = float(acc.nonfinite_micro_batches)
    if n and math.isfinite(acc.loss_sum):
        out["loss"] = acc.loss_sum / n
        out["reward_mean"] = acc.reward_sum / n
    if acc.padded_tokens:
        out["pack_fill"] = acc.real_tokens / acc.padded_tokens
    if acc.lags:
        out["version_lag_mean"] = sum(acc.lags) / len(acc.lags)
        out["version_lag_max"] = float(max(acc.lags))
        out["version_lag_last_mean"] = sum(acc.last_lags) / len(acc.last_lags)
        out["version_lag_last_max"] = float(max(acc.last_lags))
        for lag in acc.lags:
            key = f"version_lag_n{min(lag, LAG_HISTOGRAM_MAX)}"
            out[key] = out.get(key, 0.0) + 1
    if acc.lag_tokens:
        out["version_lag_token_mean"] = acc.lag_token_sum / acc.lag_tokens
    out["samples_over_lag_bound"] = float(acc.over_lag_bound)
    out.update(acc.stats.metrics())
    return out
