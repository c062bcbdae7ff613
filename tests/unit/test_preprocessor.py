"""The preprocessor on the in-memory transport: groups, advantages per token, dedupe, filter,
state rebuild after a stop mid-group, timeouts, backpressure."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
from fakes.records import f32, make_scored, make_weight_version

from stream_rl.config import RunConfig
from stream_rl.contracts import (
    PartialGroup,
    PartitionOffset,
    ScoredRollout,
    TrainingBatch,
    TrainingSample,
)
from stream_rl.kafka.memory import MemoryTransport
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.stage import StopFlag
from stream_rl.kafka.topics import SCORED, TRAINING_BATCHES, WEIGHT_VERSIONS, TopicNames
from stream_rl.rl.advantages import compute_advantages
from stream_rl.stages import preprocessor

pytestmark = pytest.mark.unit
serde = default_serde()
NAMES = TopicNames("r")


def make_config(**pre: object) -> RunConfig:
    return RunConfig.model_validate({"run": "r", "preprocessor": {"batch_size": 3, **pre}})


def transport() -> MemoryTransport:
    t = MemoryTransport()
    t.create_topics(NAMES.all_topics(partitions=2))
    return t


def produce(t: MemoryTransport, records: list[ScoredRollout]) -> None:
    p = t.producer("verifier")
    for s in records:
        p.produce(NAMES[SCORED], serde.encode(s), key=s.rollout.group_id)


def groups(n: int, g: int = 4, rewards=None) -> list[ScoredRollout]:  # type: ignore[no-untyped-def]
    out = []
    for i in range(n):
        for k in range(g):
            r = None if rewards is None else rewards(i, k)
            out.append(make_scored(i, k, g, reward=r, completion_len=3 + k))
    return out


def trained(t: MemoryTransport) -> tuple[list[TrainingSample], list[TrainingBatch]]:
    batches = [serde.decode(m.value, TrainingBatch) for m in t.messages(NAMES[TRAINING_BATCHES])]
    return [s for b in batches for s in b.samples], batches


def test_complete_groups_become_samples_with_per_token_advantages() -> None:
    t = transport()
    records = groups(3, rewards=lambda i, k: float(k == i))  # group i: sample i correct
    mt = replace(records[1].rollout, completion_mask=[True, False, True, True])  # an environment token
    records[1] = replace(records[1], rollout=mt)
    produce(t, records)
    stats = preprocessor.run(make_config(), transport=t, max_records=12, idle_timeout_s=2)
    assert stats.records_in == 12 and stats.extra["emitted"] == 3
    samples, batches = trained(t)
    assert sorted(s.rollout_id for s in samples) == sorted(r.rollout.rollout_id for r in records)
    by_id = {s.rollout_id: s for s in samples}
    for i in range(3):
        group = [r for r in records if r.rollout.group_id == records[4 * i].rollout.group_id]
        expected = compute_advantages([r.reward for r in group])
        for r, adv in zip(group, expected, strict=True):
            s = by_id[r.rollout.rollout_id]
            mask = r.rollout.sampled_mask()
            assert s.input_ids == r.rollout.prompt_token_ids + r.rollout.completion_token_ids
            assert s.prompt_len == len(r.rollout.prompt_token_ids) and s.loss_mask == mask
            assert s.advantages == [f32(adv) if m else 0.0 for m in mask]
            assert s.behaviour_logprobs == r.rollout.logprobs and s.reward == r.reward
            assert s.version_spans == r.rollout.version_spans and s.verdict == r.verdict
    assert by_id[records[1].rollout.rollout_id].advantages[1] == 0.0
    assert all(b.num_tokens <= 4096 for b in batches)
    # Every open group left the state topic closed; offsets committed.
    state = {m.key: m for m in t.messages(NAMES["preprocessor-state"])}
    assert all(serde.decode(m.value, PartialGroup).closed for m in state.values())
    assert sum(t.group_offsets(NAMES.group("preprocessor"), NAMES[SCORED]).values()) == 12


def test_duplicates_are_dropped_within_and_after_a_group() -> None:
    t = transport()
    records = groups(2)
    produce(t, records[:2] + records[1:2] + records[2:] + records[:3])  # dups mid-group and after
    stats = preprocessor.run(make_config(), transport=t, max_records=12, idle_timeout_s=2)
    samples, _ = trained(t)
    assert len(samples) == 8 and len({s.rollout_id for s in samples}) == 8
    assert stats.extra["duplicates"] == 4


def test_zero_advantage_groups_are_filtered_and_counted() -> None:
    t = transport()
    produce(t, groups(3, rewards=lambda i, k: 1.0 if i == 0 else float(k % 2)))  # group 0: all equal
    stats = preprocessor.run(
        make_config(filter_zero_advantage=True), transport=t, max_records=12, idle_timeout_s=2
    )
    samples, batches = trained(t)
    assert len(samples) == 8 and stats.extra["filtered"] == 1
    assert sum(b.num_filtered for b in batches) == 4
    assert not any(s.group_id == groups(1)[0].rollout.group_id for s in samples)


def test_restart_mid_group_rebuilds_partial_groups_from_the_state_topic() -> None:
    t = transport()
    records = groups(4)
    produce(t, records)
    preprocessor.run(make_config(), transport=t, max_records=6, idle_timeout_s=2)  # mid-group stop
    state = [serde.decode(m.value, PartialGroup) for m in t.messages(NAMES["preprocessor-state"]) if m.value]
    assert any(not s.closed and s.samples for s in state)
    first, _ = trained(t)
    preprocessor.run(make_config(), transport=t, idle_timeout_s=0.5)
    samples, _ = trained(t)
    assert len(first) < 16
    assert sorted(s.rollout_id for s in samples) == sorted(r.rollout.rollout_id for r in records)


def test_incomplete_groups_time_out_to_the_dlq_and_count_as_consumed() -> None:
    t = transport()
    records = groups(2)
    produce(t, records[:7])  # the second group misses a sample
    stats = preprocessor.run(make_config(group_timeout_s=0.2), transport=t, idle_timeout_s=1)
    samples, batches = trained(t)
    assert len(samples) == 4 and stats.extra["timed_out"] == 1
    assert sum(b.num_filtered for b in batches) == 4  # the whole group_size is accounted for
    dlq = t.messages(NAMES.dlq(SCORED))
    assert len(dlq) == 3 and all(b"incomplete group" in (m.header("error") or b"") for m in dlq)
    # The missing sample arriving late is a duplicate of a closed group, not a new group.
    produce(t, records[7:])
    stats = preprocessor.run(make_config(group_timeout_s=0.2), transport=t, max_records=1, idle_timeout_s=1)
    assert stats.extra["duplicates"] == 1 and len(trained(t)[0]) == 4


def test_a_group_size_disagreement_goes_to_the_dlq() -> None:
    t = transport()
    records = groups(1)
    odd = replace(records[3], rollout=replace(records[3].rollout, group_size=5, sample_index=3))
    produce(t, records[:3] + [odd])
    stats = preprocessor.run(make_config(), transport=t, max_records=4, idle_timeout_s=1)
    assert stats.dlq == 1 and trained(t)[0] == []


def test_backpressure_holds_until_the_trainer_catches_up() -> None:
    t = transport()
    p = t.producer("x")
    for _ in range(5):
        p.produce(NAMES[TRAINING_BATCHES], b"batch", key="b")
    stop = StopFlag()
    pre = preprocessor.Preprocessor(make_config(max_untrained_batches=3), t, stop, 0)
    pre.follower.start()
    try:
        assert pre.untrained() == 5
        released = threading.Event()
        thread = threading.Thread(target=lambda: (pre.hold(), released.set()), daemon=True)
        thread.start()
        assert not released.wait(0.5)  # holding: 5 > 3
        # The trainer reports what it consumed in its WeightVersion.
        wv = replace(
            make_weight_version(1, run_id="r"),
            consumed_offsets=[PartitionOffset(NAMES[TRAINING_BATCHES], 0, 2)],
        )
        p.produce(NAMES[WEIGHT_VERSIONS], serde.encode(wv), key="r")
        assert released.wait(5)  # 3 <= 3
        assert pre.untrained() == 3
    finally:
        stop.set()
        pre.follower.stop()


def test_the_bound_covers_two_optimizer_steps() -> None:
    config = RunConfig.model_validate(
        {"run": "r", "preprocessor": {"max_untrained_batches": 4}, "trainer": {"samples_per_step": 64}}
    )
    pre = preprocessor.Preprocessor(config, transport(), StopFlag(), 0)
    assert pre.bound() == 4
    pre.counts.update(offsets=10, samples=40)  # 4 samples per offset: 16 offsets per step
    assert pre.bound() == 32


def test_samples_and_filtered_counts_carry_the_problems_partition() -> None:
    """What the trainer counts per partition (`consumed_by_partition`, admission's R with several
    actors): each sample keeps its rollout's `problem_partition`, filtered samples are counted by it."""
    t = transport()
    # group 0 (partition 3) learns something; group 1 (partition 1) is all equal: filtered.
    records = [
        replace(
            s,
            rollout=replace(
                s.rollout, problem_partition=3 if s.rollout.problem.problem_id.endswith("0") else 1
            ),
        )
        for s in groups(2, rewards=lambda i, k: float(k == 0) if i == 0 else 1.0)
    ]
    assert {s.rollout.problem_partition for s in records} == {1, 3}
    produce(t, records)
    preprocessor.run(make_config(filter_zero_advantage=True), transport=t, max_records=8, idle_timeout_s=2)
    samples, batches = trained(t)
    assert {s.problem_partition for s in samples} == {3} and len(samples) == 4
    assert sum(b.num_filtered for b in batches) == 4
    assert [b.filtered_by_partition for b in batches if b.num_filtered] == [{1: 4}]
