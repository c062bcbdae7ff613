"""The trainer stage: `training-batches` in; optimizer steps, weight broadcasts, `weight-versions` out.

Consumes `training-batches` with the group `trainer`, assigned explicitly at its checkpoint's
offsets (the topic has one partition: one trainer reads every micro-batch, in order; that order
is what makes replays bit-exact). Produces one `WeightVersion` per version on `weight-versions`,
checkpoints, and weight broadcasts to every inference server. Not a `StageLoop`: offsets are
committed after checkpoints, not after each batch.

Per step: micro-batches are trained as they arrive (gradients accumulate) until the samples
consumed, trained plus the preprocessor's `num_filtered`, reach `trainer.samples_per_step`.
Micro-batches are never split, so a step may exceed the target by less than one micro-batch;
the loss is divided by the sequences actually trained in the step. Then: one AdamW step,
`version += 1`, push to every server (a failing server is reported and dropped, the run goes on),
checkpoint when due, publish the `WeightVersion`, and only after a durable checkpoint commit the
consumed offsets. Undecodable or unusable micro-batches go to `training-batches.dlq`.

Servers joining and leaving the run (`servers`, `stream_rl.kafka.servers_topic`): a joined server is
joined to the weight sync and pushed the current version as soon as the record is read (between
micro-batches), so it holds the newest version before any actor routes to it; a draining or left
one is dropped and never re-joined (`stream_rl.train.roster`).

While no input comes (at most every `server_sync.RECONNECT_EVERY_S`): live servers are asked the
version they hold, one older than the last push (restarted since, no push failed on it) is
dropped; dropped servers that answer `/health` re-join; and those are pushed the current version
at once (`stream_rl.train.server_sync`).

Start: resume from the latest checkpoint if there is one (weights, optimizer, schedule, RNG,
counters, offsets), else the model at `model.path` as version 0. Broadcast that version to every
server, then publish it (version 0 with kind `init`) unless the lineage already holds it. After a
restart the steps after the checkpoint are re-trained from the same offsets; training is
deterministic, so versions already in the lineage are verified by checksum instead of published
twice. A mismatch is logged as an error, counted, and published (the servers hold those weights).

Stop (SIGTERM, `--max-steps`, `--idle-timeout`, or `trainer.max_steps`, whose version is
published with kind `final`): the step being filled is abandoned (its micro-batches are consumed
again after a restart; training them as a short step would cut steps differently from an
uninterrupted run), the last completed step is checkpointed and its offsets committed.

Run alone: `stream-rl trainer --config run.yaml [--max-steps N] [--idle-timeout S] [--metrics-port P]`.
For `replay trainer` the first start writes the run record (`stream_rl.train.record`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from stream_rl.common import heap
from stream_rl.common.metrics import RECORDS_IN, UP
from stream_rl.config import RunConfig
from stream_rl.contracts import EvalResult, PartitionOffset, TrainingBatch, WeightVersion, WeightVersionKind
from stream_rl.errors import ConfigError, ContractError, KafkaError
from stream_rl.kafka.dead_letters import DeadLetters
from stream_rl.kafka.follower import RecordFollower
from stream_rl.kafka.serde import Serde, default_serde
from stream_rl.kafka.stage import StopFlag
from stream_rl.kafka.topics import EVAL_RESULTS, TRAINING_BATCHES, WEIGHT_VERSIONS, TopicNames
from stream_rl.kafka.transport import Consumer, Message, Producer, Transport
from stream_rl.stages.entry import add_stage_arguments, open_transport, stage_config, start_stage
from stream_rl.train import metrics as tm
from stream_rl.train.backends import build_trainer
from stream_rl.train.checkpoint import (
    CheckpointError,
    TrainerState,
    checkpoint_root,
    latest_checkpoint,
    read_state,
    restore_rng,
    save_checkpoint,
)
from stream_rl.train.dedupe import TrainedIds
from stream_rl.train.lineage import by_version, read_weight_versions
from stream_rl.train.push import PushOutcome, WeightPusher, make_sender
from stream_rl.train.record import write_run_record
from stream_rl.train.server_sync import ServerSync
from stream_rl.train.step import TrainerBackend
from stream_rl.train.step_runner import StepRunner, unusable_reason

log = logging.getLogger(__name__)

STAGE = "trainer"
CONSUMES = TRAINING_BATCHES
PRODUCES = (WEIGHT_VERSIONS,)


@dataclass
class TrainerStats:
    version: int = 0
    steps: int = 0
    """Optimizer steps taken by this process (re-trained ones included)."""
    micro_batches: int = 0
    dlq: int = 0
    published: int = 0
    verified: int = 0
    """Re-trained versions found in the lineage with the same checksum (not published again)."""
    mismatches: int = 0
    duplicates: int = 0
    """Samples dropped because their id was trained before (`stream_rl.train.dedupe`)."""
    skipped_steps: int = 0
    """Steps whose gradient was not finite (not applied)."""
    restarted_servers: int = 0
    """Live servers found holding an older version than pushed them (restarted): re-joined, re-pushed."""
    checksum: str = ""
    stopped_by: str = ""


class TrainerStage:
    """One trainer process; `run()` trains until stopped. See the module docstring."""

    def __init__(
        self,
        config: RunConfig,
        transport: Transport,
        *,
        pusher: WeightPusher | None = None,
        stop: StopFlag | None = None,
        serde: Serde | None = None,
    ) -> None:
        self.config = config
        self.tcfg = config.trainer
        self.transport = transport
        self.names = TopicNames(run=config.run, prefix=config.kafka.prefix)
        self.input_topic = self.names.topic(TRAINING_BATCHES)
        self.dlq_topic = self.names.dlq(TRAINING_BATCHES)
        self.dead_letters = DeadLetters(STAGE, self.dlq_topic)
        self.out_topic = self.names.topic(WEIGHT_VERSIONS)
        self.bucket_bytes = int(self.tcfg.bucket_mb * 2**20)
        self.servers = ServerSync(
            config, pusher if pusher is not None else make_sender(config), self.bucket_bytes
        )
        self.stop = stop if stop is not None else StopFlag()
        self.serde = serde or default_serde()
        self.ckpt_dir = checkpoint_root(config)
        self.stats = TrainerStats()
        self._checkpointed_step = -1
        self._last_step_end = time.monotonic()
        self._published_here: set[int] = set()
        self._evals: RecordFollower[EvalResult] | None = None
        if config.eval.every and config.eval.pin:
            self._evals = RecordFollower(
                transport, self.names.topic(EVAL_RESULTS), EvalResult, f"{STAGE}-evals", self.serde
            )
        self.trainer: TrainerBackend  # set by _load()
        self.producer: Producer  # set by run()

    # -- start -------------------------------------------------------------------------------

    def _load(self) -> None:
        ckpt = latest_checkpoint(self.ckpt_dir)
        self.trainer = build_trainer(self.config, ckpt / "model" if ckpt else None)
        self.trained = TrainedIds.load(ckpt, self.tcfg.dedupe_window)
        if ckpt is None:
            self.state = TrainerState(checksum=self.trainer.checksum())
            write_run_record(self.config, self.state.checksum)
            return
        self.state = read_state(ckpt)
        self.trainer.load_from(ckpt)
        restore_rng(ckpt)
        if self.trainer.checksum() != self.state.checksum:
            raise CheckpointError(f"{ckpt}: weights do not match the checksum recorded with them")
        self._checkpointed_step = self.state.step
        log.info("resuming from %s (version %d)", ckpt, self.state.version)

    @property
    def pusher(self) -> WeightPusher | None:
        return self.servers.pusher

    # -- weights out -------------------------------------------------------------------------

    def _sync(self, version: int) -> tuple[str, PushOutcome | None]:
        """The weights' checksum, and the push of `version` to the servers (gathered once)."""
        from stream_rl.weights.checksum import weights_checksum

        self.servers.rejoin_due()
        with self.trainer.full_weights() as named:
            checksum = weights_checksum(named)
            report = self.servers.push(version, named)
        return checksum, report

    def _publish(
        self,
        kind: WeightVersionKind,
        report: PushOutcome | None,
        metrics: dict[str, float],
        checkpoint_uri: str | None = None,
    ) -> None:
        st = self.state
        wv = WeightVersion(
            run_id=self.config.run,
            version=st.version,
            step=st.step,
            kind=kind,
            samples_trained=st.samples_trained,
            tokens_trained=st.tokens_trained,
            samples_filtered=st.samples_filtered,
            checksum=st.checksum,
            consumed_offsets=[PartitionOffset(t, p, o) for (t, p), o in sorted(st.offsets.items())],
            broadcast_ms=report.broadcast_ms if report else 0.0,
            servers_updated=sorted(report.updated) if report else [],
            servers_failed=sorted(report.failed) if report else [],
            checkpoint_uri=checkpoint_uri,
            metrics=metrics,
            consumed_by_partition=dict(sorted(st.consumed_by_partition.items())),
        )
        known = self.history.pop(st.version, None)
        if known is not None:
            if known.checksum == wv.checksum:
                self.stats.verified += 1
                return
            log.error(
                "version %d re-trained with checksum %s, but the lineage has %s: training was not "
                "deterministic (threads, library versions, or batches changed); publishing the new one",
                st.version,
                wv.checksum[:16],
                known.checksum[:16],
            )
            tm.CHECKSUM_MISMATCH.inc()
            self.stats.mismatches += 1
            wv.metrics["checksum_mismatch"] = 1.0
        self.producer.produce(self.out_topic, self.serde.encode(wv), key=self.config.run)
        self.producer.flush()
        self._published_here = {st.version}  # only the last one matters to the eval hold
        self.stats.published += 1

    def _checkpoint(self, consumer: Consumer | None) -> str:
        def write(directory: Path) -> None:
            self.trainer.save_to(directory)
            self.trained.save(directory)

        path = save_checkpoint(self.ckpt_dir, write, self.state, keep=self.tcfg.keep_checkpoints)
        self._checkpointed_step = self.state.step
        tm.CHECKPOINTS.inc()
        heap.trim()  # the serialised state's buffers are freed: hand their pages back
        if consumer is not None and self.state.offsets:
            self._commit(consumer)  # only now: the checkpoint is durable
        return path.resolve().as_uri()

    def _commit(self, consumer: Consumer) -> None:
        """Commit the checkpoint's offsets to the group. They are informational (lag, status): the
        trainer resumes from its checkpoint's own offsets, so a failure is logged, not fatal."""
        try:
            consumer.commit(dict(self.state.offsets))
        except KafkaError as exc:
            log.warning("committing the trainer's offsets failed (the checkpoint has them): %s", exc)

    # -- one step ----------------------------------------------------------------------------

    def _hold_for_eval(self, version: int) -> None:
        """`eval.pin`: before pushing `version`, wait until the evaluation of the version before it
        is published when that one is due and was published by this process (so the evaluator
        samples exactly it; `stream_rl/stages/evaluator.py`), at most `eval.timeout_s`."""
        from stream_rl.stages.evaluation import is_due

        previous = version - 1
        ecfg = self.config.eval
        if self._evals is None or previous not in self._published_here:
            return
        if not is_due(previous, ecfg.every, final=False):
            return
        started = time.monotonic()
        while not any(ev.version == previous for ev in self._evals.records):
            if self.stop or time.monotonic() - started > ecfg.timeout_s:
                log.warning(
                    "no evaluation of version %d within %.0fs: pushing %d", previous, ecfg.timeout_s, version
                )
                return
            time.sleep(0.05)
        tm.EVAL_HOLD_SECONDS.inc(time.monotonic() - started)

    def _finish_step(self, runner: StepRunner, consumer: Consumer) -> None:
        summary = runner.finish()
        acc, st, tcfg = summary.acc, self.state, self.tcfg
        st.version += 1
        st.step += 1
        st.samples_trained += acc.samples_trained
        st.tokens_trained += acc.tokens
        st.samples_filtered += acc.samples_filtered
        st.offsets.update(acc.offsets)
        for p, n in acc.consumed_by_partition.items():
            st.consumed_by_partition[p] = st.consumed_by_partition.get(p, 0) + n
        self.stats.duplicates += acc.duplicates
        if summary.outcome.skipped:
            self.stats.skipped_steps += 1
            tm.SKIPPED_STEPS.inc()
            log.error(
                "version %d: the gradient is not finite (grad_norm %s): step skipped, weights unchanged",
                st.version,
                summary.outcome.grad_norm,
            )
        self._hold_for_eval(st.version)
        st.checksum, report = self._sync(st.version)
        final = st.version >= tcfg.max_steps
        uri = None
        started = time.monotonic()
        if final or (tcfg.checkpoint_every and st.step % tcfg.checkpoint_every == 0):
            uri = self._checkpoint(None)
        now = time.monotonic()
        metrics = dict(summary.metrics)
        step_s = now - self._last_step_end
        metrics.update(
            step_s=step_s,
            wait_s=max(0.0, step_s - acc.compute_s),
            samples_per_s=acc.consumed / step_s if step_s > 0 else 0.0,
            broadcast_ms=report.broadcast_ms if report else 0.0,
            # bytes the built-in sender broadcast for this version, over all servers (docs/weight-pushes.md)
            push_bytes=sum(t.get("bytes", 0.0) for t in report.per_server.values()) if report else 0.0,
            checkpoint_ms=(now - started) * 1000 if uri else 0.0,
        )
        if self.servers.restarted_since_step:  # found while idle before this step
            metrics["servers_restarted"] = float(self.servers.restarted_since_step)
            self.servers.restarted_since_step = 0
        self._last_step_end = now
        self._publish(WeightVersionKind.FINAL if final else WeightVersionKind.UPDATE, report, metrics, uri)
        if uri is not None and st.offsets:
            self._commit(consumer)
        tm.observe_step(st.version, metrics, acc.lags)
        self.stats.steps += 1
        log.info(
            "version %d: %d samples, loss %.4f, grad_norm %.3f, lag %.2f, %.0f tok/s",
            st.version,
            acc.samples_trained,
            metrics.get("loss", 0.0),
            metrics.get("grad_norm", float("nan")),
            metrics.get("version_lag_mean", 0.0),
            metrics["tokens_per_s"],
        )

    def _usable(self, msg: Message) -> TrainingBatch | str:
        """The decoded batch, or why it goes to the DLQ."""
        try:
            batch = self.serde.decode(msg.value, TrainingBatch)
        except ContractError as exc:
            return str(exc)
        reason = unusable_reason(batch, self.trainer.vocab_size)
        return batch if reason is None else reason

    def _to_dlq(self, msg: Message, error: str) -> None:
        self.dead_letters.write(self.producer, msg, error)
        self.producer.flush()
        self.stats.dlq += 1

    # -- the loop ----------------------------------------------------------------------------

    def run(self, max_steps: int | None = None, idle_timeout_s: float | None = None) -> TrainerStats:
        """Train until stopped, the version reaches `max_steps` (default `trainer.max_steps`),
        or `idle_timeout_s` passes without input."""
        target = min(max_steps, self.tcfg.max_steps) if max_steps is not None else self.tcfg.max_steps
        consumer: Consumer | None = None
        producer: Producer | None = None
        clean = False
        UP.labels(STAGE).set(1)
        try:
            self._load()
            if self._evals is not None:
                self._evals.start()
            # Only the versions this process may re-train (those after its checkpoint) are kept: the
            # lineage of a long run would otherwise stay in memory (and grow with every version).
            lineage = by_version(read_weight_versions(self.transport, self.names, self.serde))
            self.history = {v: wv for v, wv in lineage.items() if v >= self.state.version}
            self.producer = producer = self.transport.producer(f"{STAGE}-{self.config.run}")
            consumer = self.transport.consumer(self.names.group(STAGE), STAGE)
            self.servers.start(self.transport, self.names, self.serde, self.stop)
            kind = WeightVersionKind.INIT if self.state.version == 0 else WeightVersionKind.UPDATE
            if self.state.version >= self.tcfg.max_steps:
                kind = WeightVersionKind.FINAL
            self._publish(kind, self._sync(self.state.version)[1], {})
            tm.VERSION.set(self.state.version)
            parts = sorted(self.transport.watermarks(self.input_topic))
            consumer.assign(
                {(self.input_topic, p): self.state.offsets.get((self.input_topic, p), 0) for p in parts}
            )
            heap.settle()
            self._loop(consumer, target, idle_timeout_s)
            clean = True
        finally:
            try:
                if clean and self.state.step > 0 and self._checkpointed_step != self.state.step:
                    self._checkpoint(consumer)
            finally:
                UP.labels(STAGE).set(0)
                trainer: TrainerBackend | None = getattr(self, "trainer", None)
                # Each is closed even when one before it raises (the first error is raised after).
                with contextlib.ExitStack() as closing:
                    if self._evals is not None:
                        closing.callback(self._evals.stop)
                    for closer in (self.servers, producer, consumer, trainer):  # closed last to first
                        if closer is not None:
                            closing.callback(closer.close)  # DeepSpeed: releases the other ranks
        self.stats.restarted_servers = self.servers.restarted
        self.stats.version = self.state.version
        self.stats.checksum = self.state.checksum
        return self.stats

    def _loop(self, consumer: Consumer, target: int, idle_timeout_s: float | None) -> None:
        runner = StepRunner(
            self.trainer, self.tcfg.pack_row_tokens, self.trained, lag_bound=self.config.lag_bound
        )
        buffer: deque[Message] = deque()
        last_input = time.monotonic()
        while True:
            if self.stop:
                self.stats.stopped_by = self.stop.reason or "stopped"
                return
            if self.state.version >= target:
                self.stats.stopped_by = "max_steps"
                return
            self.servers.check_members(self.trainer.full_weights, self.state.version)
            if not buffer:
                msgs = consumer.poll_batch(64, 0.2)
                if not msgs:
                    if idle_timeout_s is not None and time.monotonic() - last_input >= idle_timeout_s:
                        self.stats.stopped_by = "idle_timeout"
                        return
                    self.servers.while_idle(self.trainer.full_weights, self.state.version)
                    continue
                buffer.extend(msgs)
                last_input = time.monotonic()
            msg = buffer.popleft()
            RECORDS_IN.labels(STAGE, msg.topic).inc()
            batch = self._usable(msg)
            if isinstance(batch, str):
                self._to_dlq(msg, batch)
            else:
                runner.add(batch, self.state.version)
                self.stats.micro_batches += 1
            runner.note_offset(msg.tp, msg.offset + 1)
            if runner.acc.consumed >= self.tcfg.samples_per_step:
                self._finish_step(runner, consumer)


def run(
    config: RunConfig,
    transport: Transport | None = None,
    *,
    pusher: WeightPusher | None = None,
    stop: StopFlag | None = None,
    max_steps: int | None = None,
    idle_timeout_s: float | None = None,
) -> TrainerStats:
    """Run the trainer stage (see the module docstring). `transport` defaults to Kafka at the
    configured bootstrap, `pusher` to a `WeightSender` for the configured servers."""
    stage = TrainerStage(config, open_transport(config, transport), pusher=pusher, stop=stop)
    return stage.run(max_steps=max_steps, idle_timeout_s=idle_timeout_s)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_stage_arguments(parser, bound="steps", bound_help="stop once the version reaches N")


def main(args: argparse.Namespace) -> int:
    """`stream-rl trainer`: the shared stage entry (`stream_rl.stages.entry`), bounded by steps;
    `/metrics` on `--metrics-port`, else `trainer.metrics_port`."""
    config = stage_config(args, "trainer")
    if args.instance != "0":
        raise ConfigError(
            "one trainer per run: --instance must be 0 (ranks come from the distributed launcher)"
        )
    if config.trainer.backend == "deepspeed":
        from stream_rl.train import deepspeed_backend, ranks

        deepspeed_backend.init_distributed(config.trainer.device)
        if ranks.is_follower():
            deepspeed_backend.follow(config)
            ranks.shutdown()
            return 0
    if config.trainer.backend == "fsdp2":
        from stream_rl.train import fsdp_backend, ranks

        fsdp_backend.init_distributed(config.trainer.device)
        if ranks.is_follower():
            fsdp_backend.follow(config)
            ranks.shutdown()
            return 0
    port = args.metrics_port if args.metrics_port is not None else config.trainer.metrics_port
    stop = start_stage(STAGE, port)
    stats = run(config, stop=stop, max_steps=args.max_steps, idle_timeout_s=args.idle_timeout)
    if config.trainer.backend in ("deepspeed", "fsdp2"):
        from stream_rl.train import ranks

        ranks.shutdown()
    print(
        f"trainer stopped ({stats.stopped_by}): version {stats.version}, {stats.steps} steps, "
        f"{stats.micro_batches} micro-batches, {stats.dlq} to the DLQ, checksum {stats.checksum[:16]}"
    )
    return 0
