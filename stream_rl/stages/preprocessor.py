"""The preprocessor: complete groups -> advantages -> packed micro-batches, exactly once.

Consumes `scored` (consumer group `preprocessor`; key = group_id, so a group never spans
partitions). Produces `training-batches` (key = batch_id) and its own compacted state in
`preprocessor-state` (key = group_id, partition = the scored partition); incomplete groups that
time out go to `scored.dlq`.

Per polled batch, ONE Kafka transaction holds: the micro-batches of the groups that became
complete, the updated state of every group the batch touched (open: its samples so far;
closed: a marker, plus tombstones of markers evicted from the dedupe window), and the input
offsets. So after any crash (kill -9 included) the committed state and the committed offsets
agree: a restarted instance (same `--instance`, hence the same transactional id, which fences
its dead predecessor at once) rebuilds the partial groups of each partition it is assigned from
the state topic (read to its end, read_committed) and resumes at the committed offset. Every
sample reaches `training-batches` exactly once and every group is complete (or dead-lettered).

- Duplicates (a sample re-delivered by an at-least-once upstream, within the group or after it
  was emitted) are dropped by rollout_id / closed group id and counted (`DUPLICATES`).
- Advantages per group (`stream_rl.rl.advantages`); per-token advantages and loss masks in
  `grouping.training_samples`. `filter_zero_advantage` drops groups whose advantages are all 0:
  their sample count rides in `TrainingBatch.num_filtered`, as does the group size of a group
  dead-lettered after `group_timeout_s`, so the trainer's `samples_consumed` (the actor's
  admission) accounts for every admitted sample.
- Packing: `micro_batches.pack` (in arrival order, `max_tokens_per_microbatch`, `max_batch_bytes`).
- Backpressure: before each poll, hold while the offsets of `training-batches` written but not
  consumed by the trainer (as its latest `WeightVersion` reports) exceed `max_untrained_batches`,
  raised at run time to two optimizer steps' worth so that the trainer can always step.

Run alone: `stream-rl preprocessor --config run.yaml [--instance ID]`. `stream-rl replay
preprocessor` (`preprocessor_replay.py`) runs this same class on another run's `scored`.
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from collections.abc import Callable

from prometheus_client import Counter

from stream_rl.common.metrics import DUPLICATES
from stream_rl.config import RunConfig
from stream_rl.contracts import PartialGroup, PendingSample, ScoredRollout, TrainingSample, now_ms
from stream_rl.errors import ConfigError, KafkaError
from stream_rl.kafka.dead_letters import DeadLetters
from stream_rl.kafka.follower import VersionFollower
from stream_rl.kafka.hanging import CHECK_AFTER_S
from stream_rl.kafka.reader import Unsettled, read_to_end
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.stage import Incoming, Output, Reject, StageLoop, StageStats, StopFlag
from stream_rl.kafka.topics import SCORED, TRAINING_BATCHES, TopicNames
from stream_rl.kafka.transport import Message, TopicPartition, Transport
from stream_rl.stages.entry import Instance, add_stage_arguments, open_transport, run_stage_command
from stream_rl.stages.grouping import Added, PartitionGroups, group_advantages, training_samples
from stream_rl.stages.micro_batches import pack

log = logging.getLogger(__name__)

STATE = "preprocessor-state"
CONSUMES = SCORED
PRODUCES = (TRAINING_BATCHES, STATE)

REBUILD_SETTLE_S = 60.0
"""How long a rebuild waits for the state partition's transactions to be decided (a live producer's
is decided within its transaction timeout, 15 s); then the stage exits and is restarted."""
BACKLOG_CHECK_S = 1.0
"""How often the backlog is re-read while within the bound (each check is broker requests)."""
GROUPS = Counter("stream_rl_preprocessor_groups", "Complete groups by outcome", ["outcome"])


class Preprocessor:
    def __init__(
        self,
        config: RunConfig,
        transport: Transport,
        stop: StopFlag,
        instance: Instance,
        scored_topic: str | None = None,
    ) -> None:
        """`scored_topic` overrides the input (default: the run's own `scored`); `replay
        preprocessor` reads another run's. Everything written stays in `config.run`'s namespace."""
        self.config = config
        self.cfg = config.preprocessor
        self.transport = transport
        self.stop = stop
        self.instance = instance
        self.names = TopicNames(config.run, config.kafka.prefix)
        self.scored_topic = scored_topic or self.names[SCORED]
        self.state_topic = self.names[STATE]
        self.batches_topic = self.names[TRAINING_BATCHES]
        self.dead_letters = DeadLetters("preprocessor", self.names.dlq(SCORED))
        self.producer_id = f"preprocessor-{instance}"
        self.serde = default_serde()
        self.parts: dict[int, PartitionGroups] = {}
        self.counts = {
            "duplicates": 0,
            "emitted": 0,
            "filtered": 0,
            "filtered_samples": 0,
            "samples_out": 0,
            "timed_out": 0,
            "bad_groups": 0,
            "batches": 0,
            "samples": 0,
            "offsets": 0,
        }
        self.abs_advantage_sum = 0.0
        """Sum of |advantage| over the samples written to training-batches (one per sample)."""
        self._last_expiry = 0.0
        self._backlog_checked = 0.0
        self._last_hold_log = 0.0
        n_scored = len(transport.watermarks(self.scored_topic))
        n_state = len(transport.watermarks(self.state_topic))
        if n_scored != n_state:
            raise ConfigError(
                f"{self.state_topic} has {n_state} partitions, {self.scored_topic} has {n_scored}: they must "
                "be equal (state record i lives in scored's partition i)"
            )
        self.follower = VersionFollower(transport, self.names, client_id=f"{self.producer_id}-versions")

    # -- partition assignment ------------------------------------------------------------------
    def rebuild(self, partition: int) -> PartitionGroups:
        """The partition's open groups and remembered closed ones, from its state topic. The read
        waits first until every transaction in the state partition is decided (`REBUILD_SETTLE_S`):
        a partition taken over from another instance would otherwise miss that instance's last
        commit if its markers are not yet written (a group's last samples, a closed group's marker).
        A transaction no coordinator will ever decide (a hanging one: docs/faults.md) is aborted by
        the launcher; past the bound this is one line naming `stream-rl hanging`."""
        groups = PartitionGroups(partition, self.cfg.dedupe_window)
        n = 0
        try:
            for msg in read_to_end(
                self.transport,
                self.state_topic,
                [partition],
                client_id=f"{self.producer_id}-state",
                settle_s=REBUILD_SETTLE_S,
            ):
                key = (msg.key or b"").decode()
                record = None if msg.value is None else self.serde.decode(msg.value, PartialGroup)
                groups.restore(key, record, self.serde)
                n += 1
        except Unsettled as exc:
            raise KafkaError(
                f"{self.producer_id}: partition {partition}'s state cannot be rebuilt: {exc}. If no "
                "producer holds it (a hanging transaction, KIP-664), `stream-rl hanging --run "
                f"{self.config.run} --config <the run's config> --abort` ends it; the launcher "
                f"does so itself after {CHECK_AFTER_S:.0f}s without a new weight version"
            ) from exc
        log.info(
            "%s: partition %d: %d open groups, %d closed remembered (%d state records read)",
            self.producer_id,
            partition,
            len(groups.open),
            len(groups.closed),
            n,
        )
        return groups

    def on_assign(self, partitions: list[TopicPartition]) -> None:
        for topic, p in partitions:
            if topic == self.scored_topic:
                self.parts[p] = self.rebuild(p)

    def on_revoke(self, partitions: list[TopicPartition]) -> None:
        for topic, p in partitions:
            if topic == self.scored_topic:
                self.parts.pop(p, None)

    # -- one transaction -----------------------------------------------------------------------
    def handle(self, batch: list[Incoming[ScoredRollout]]) -> list[Output | Reject]:
        out: list[Output | Reject] = []
        now = now_ms()
        touched: dict[tuple[int, str], None] = {}
        complete: list[tuple[int, str]] = []
        for item in batch:
            task = item.value.rollout.problem.task
            if task != self.config.task.name:
                out.append(
                    Reject(item, f"rollout of task {task!r}; this run's task is {self.config.task.name!r}")
                )
                continue
            p = item.msg.partition
            groups = self.parts.get(p)
            if groups is None:  # assigned without the callback (in-memory transport): rebuild now
                groups = self.parts[p] = self.rebuild(p)
            r = item.value.rollout
            result = groups.add(
                item.value, PendingSample(r.rollout_id, item.msg.offset, item.msg.value or b""), now
            )
            if result is Added.DUPLICATE:
                self.counts["duplicates"] += 1
                DUPLICATES.labels("preprocessor").inc()
            elif result is Added.MISMATCH:
                out.append(Reject(item, f"group_size {r.group_size} differs from the group's other samples"))
            elif result is Added.COMPLETE:
                complete.append((p, r.group_id))
                touched.pop((p, r.group_id), None)
            else:
                touched[(p, r.group_id)] = None
        for p, gid in touched:
            out.append(self._state(p, gid, self.parts[p].open_record(gid, now)))
        done = set(complete)
        out.extend(self._emit(complete, [x for x in self._expired(now) if x not in done], now))
        return out

    def on_idle(self) -> list[Output | Reject]:
        now = now_ms()
        return self._emit([], self._expired(now), now)

    def _state(self, partition: int, group_id: str, record: PartialGroup | None) -> Output:
        return Output(self.state_topic, record, key=group_id, partition=partition)

    def _expired(self, now: int) -> list[tuple[int, str]]:
        if time.monotonic() - self._last_expiry < 1.0:
            return []
        self._last_expiry = time.monotonic()
        timeout_ms = self.cfg.group_timeout_s * 1000
        return [(p, gid) for p, groups in self.parts.items() for gid in groups.expired(now, timeout_ms)]

    def _emit(
        self, complete: list[tuple[int, str]], expired: list[tuple[int, str]], now: int
    ) -> list[Output | Reject]:
        out: list[Output | Reject] = []
        samples: list[TrainingSample] = []
        filtered, filtered_keys = 0, []
        filtered_by: dict[int, int] = {}  # by problems partition: the trainer's per-partition R
        timed_out = set(expired)
        for p, gid in complete + expired:
            groups = self.parts[p]
            group, evicted = groups.close(gid)
            assert group is not None
            out.append(self._state(p, gid, groups.closed_record(gid, group.first_seen_ms, now)))
            out.extend(self._state(p, old, None) for old in evicted)
            scored = group.scored()
            origin = scored[0].rollout.problem_partition if scored else -1
            pending = sorted((ps for _s, ps in group.samples.values()), key=lambda ps: ps.offset)
            if (p, gid) in timed_out:
                error = (
                    f"incomplete group {gid}: {len(pending)} of {group.group_size} samples after "
                    f"{self.cfg.group_timeout_s:g}s"
                )
                self.counts["timed_out"] += 1
                GROUPS.labels("timed_out").inc()
                out.extend(self._dead_letter(p, gid, pending, error))
                filtered += group.group_size
                filtered_by[origin] = filtered_by.get(origin, 0) + group.group_size
                filtered_keys.append(gid)
                continue
            try:
                advantages = group_advantages(scored, self.cfg)
                if not all(math.isfinite(a) for a in advantages):
                    raise ValueError(f"non-finite advantages {advantages}")
            except (ValueError, OverflowError) as exc:
                # Bad numbers must not abort the transaction (and so the stage): the group's
                # samples go to the DLQ, and count as consumed for the admission's accounting.
                self.counts["bad_groups"] += 1
                GROUPS.labels("bad").inc()
                out.extend(self._dead_letter(p, gid, pending, f"group {gid}: advantages: {exc}"))
                filtered += group.group_size
                filtered_by[origin] = filtered_by.get(origin, 0) + group.group_size
                filtered_keys.append(gid)
                continue
            if self.cfg.filter_zero_advantage and all(a == 0.0 for a in advantages):
                filtered += len(scored)
                filtered_by[origin] = filtered_by.get(origin, 0) + len(scored)
                filtered_keys.append(gid)
                self.counts["filtered"] += 1
                self.counts["filtered_samples"] += len(scored)
                GROUPS.labels("filtered").inc()
                continue
            samples.extend(training_samples(scored, advantages))
            self.counts["samples_out"] += len(scored)
            self.abs_advantage_sum += math.fsum(abs(a) for a in advantages)
            self.counts["emitted"] += 1
            GROUPS.labels("emitted").inc()
        for tb, data in pack(
            samples,
            max_tokens=self.cfg.max_tokens_per_microbatch,
            max_samples=self.cfg.max_samples_per_microbatch,
            max_bytes=self.cfg.max_batch_bytes,
            num_filtered=filtered,
            filtered_by_partition=filtered_by,
            filtered_keys=filtered_keys,
            encode=self.serde.encode,
            run_id=self.config.run,
            producer_id=self.producer_id,
        ):
            out.append(Output(self.batches_topic, data, key=tb.batch_id))
            self.counts["batches"] += 1
            self.counts["offsets"] += 1
            self.counts["samples"] += tb.num_samples + tb.num_filtered
        if samples or filtered:
            self.counts["offsets"] += 1  # the transaction's commit marker in training-batches
        return out

    def _dead_letter(self, p: int, gid: str, pending: list[PendingSample], error: str) -> list[Output]:
        """The group's samples as dead letters, inside the batch's transaction."""
        out = []
        for ps in pending:
            dl = self.dead_letters.letter(
                Message(self.scored_topic, p, ps.offset, gid.encode(), ps.record), error
            )
            out.append(Output(dl.topic, dl.value, key=dl.key, headers=dl.headers))
        return out

    # -- backpressure --------------------------------------------------------------------------
    def open_groups(self) -> int:
        """Groups holding some but not all of their samples, on the assigned partitions."""
        return sum(len(groups.open) for groups in self.parts.values())

    def untrained(self) -> int:
        """Offsets of training-batches written and not yet consumed by the trainer, as its latest
        `WeightVersion` reports them (the trainer commits its group offsets only at checkpoints)."""
        marks = self.transport.watermarks(self.batches_topic)
        reported: dict[int, int] = {}
        latest = self.follower.latest
        for o in latest.consumed_offsets if latest else []:
            if o.topic == self.batches_topic:
                reported[o.partition] = o.offset
        return sum(max(high - max(low, reported.get(p, -1)), 0) for p, (low, high) in marks.items())

    def bound(self) -> int:
        """`max_untrained_batches`, raised to two optimizer steps' worth of offsets (at the density
        this instance writes) so that the trainer always gets enough to take its next step."""
        written, samples = self.counts["offsets"], self.counts["samples"]
        if not written or not samples:
            return self.cfg.max_untrained_batches
        per_step = math.ceil(self.config.trainer.samples_per_step * written / samples)
        return max(self.cfg.max_untrained_batches, 2 * per_step)

    def hold(self) -> None:
        """`before_poll`: wait while the trainer is more than `max_untrained_batches` behind."""
        if time.monotonic() - self._backlog_checked < BACKLOG_CHECK_S:
            return  # checked a moment ago, and it was within the bound
        while not self.stop:
            backlog = self.untrained()
            if backlog <= self.bound():
                self._backlog_checked = time.monotonic()
                return
            if time.monotonic() - self._last_hold_log > 10:
                self._last_hold_log = time.monotonic()
                log.info(
                    "%s: holding: %d batches not yet trained (bound %d)",
                    self.producer_id,
                    backlog,
                    self.bound(),
                )
            self.stop.wait(0.2)


def stage_loop(pre: Preprocessor, before_poll: Callable[[], None] | None) -> StageLoop[ScoredRollout]:
    """The preprocessor's consume-process-produce loop: `pre.scored_topic` in, one transaction per
    poll, consumer group and transactional id in `pre.config.run`'s namespace. `before_poll` is
    the backpressure hold of a live run (`pre.hold`), or the end check of a replay."""
    config = pre.config
    return StageLoop(
        name="preprocessor",
        transport=pre.transport,
        group=pre.names.group("preprocessor"),
        input_topic=pre.scored_topic,
        input_type=ScoredRollout,
        handle=pre.handle,
        dlq_topic=pre.names.dlq(SCORED),
        client_id=pre.producer_id,
        # Stable per instance: a restarted instance fences its killed predecessor at once.
        transactional_id=f"{config.kafka.prefix}.{config.run}.preprocessor.{pre.instance}",
        batch_size=config.preprocessor.batch_size,
        linger_s=config.preprocessor.linger_s,
        on_assign=pre.on_assign,
        on_revoke=pre.on_revoke,
        on_idle=pre.on_idle,
        before_poll=before_poll,
        stop=pre.stop,
    )


def run(
    config: RunConfig,
    *,
    transport: Transport | None = None,
    stop: StopFlag | None = None,
    max_records: int | None = None,
    idle_timeout_s: float | None = None,
    instance: Instance = 0,
) -> StageStats:
    """Run until stopped, `max_records` scored records consumed, or `idle_timeout_s` without input."""
    transport = open_transport(config, transport)
    stop = stop if stop is not None else StopFlag()
    pre = Preprocessor(config, transport, stop, instance)
    pre.follower.start()
    try:
        stats = stage_loop(pre, before_poll=pre.hold).run(
            max_records=max_records, idle_timeout_s=idle_timeout_s
        )
    finally:
        pre.follower.stop()
    stats.extra.update({k: float(v) for k, v in pre.counts.items()})
    return stats


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_stage_arguments(parser)


def main(args: argparse.Namespace) -> int:
    return run_stage_command("preprocessor", run, args)
