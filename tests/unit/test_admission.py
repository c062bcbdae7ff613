"""Admission arithmetic: the bound, conventional batches, the straggler guard, Kafka accounting,
and a simulation that checks the lag bound the module docstring proves."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from fakes.records import make_weight_version

from stream_rl.stages.admission import Admission, GroupView, admission_bound

pytestmark = pytest.mark.unit


def version(v: int, consumed: int):  # type: ignore[no-untyped-def]
    return replace(make_weight_version(v), samples_trained=consumed, samples_filtered=0)


def admit_all(adm: Admission, start: int, partition: int = 0) -> list[tuple[int, int]]:
    keys = []
    offset = start
    while adm.can_admit():
        key = (partition, offset)
        adm.admit(key)
        keys.append(key)
        offset += 1
    return keys


def test_bound() -> None:
    assert admission_bound("pipeline", 2, 64, 8) == 3 * 64
    assert admission_bound("pipeline", 0, 64, 8) == 64
    assert admission_bound("conventional", 5, 64, 8) == 64  # max_lag ignored
    assert admission_bound("pipeline", 0, 10, 4) == 12  # whole groups can fill a step


def test_nothing_before_version_zero() -> None:
    adm = Admission.for_config("pipeline", 1, 8, 4)
    assert not adm.can_admit()
    adm.observe(version(0, 0))
    assert adm.can_admit()


def test_pipeline_admits_up_to_the_bound_and_more_as_samples_resolve() -> None:
    adm = Admission.for_config("pipeline", 1, 8, 4)  # B = 16 samples = 4 groups
    adm.observe(version(0, 0))
    keys = admit_all(adm, 0)
    assert len(keys) == 4 and adm.admitted_samples() == 16
    for k in keys:
        adm.generated(k)
    adm.on_commit({0: 4})
    assert adm.admitted_samples() == 16 and not adm.can_admit()  # committed: still in flight
    adm.observe(version(1, 8))  # one step trained
    assert len(admit_all(adm, 4)) == 2


def test_conventional_admits_exactly_one_step_per_version() -> None:
    adm = Admission.for_config("conventional", 3, 8, 4)
    adm.observe(version(0, 0))
    first = admit_all(adm, 0)
    assert len(first) == 2  # 8 samples
    for k in first:
        adm.generated(k)
    adm.on_commit({0: 2})
    adm.observe(version(0, 0))
    assert not adm.can_admit()
    adm.observe(version(1, 8))
    assert len(admit_all(adm, 2)) == 2


def test_a_generating_straggler_holds_the_window() -> None:
    adm = Admission.for_config("pipeline", 1, 8, 4)
    adm.observe(version(0, 0))
    keys = admit_all(adm, 0)
    for k in keys[1:]:
        adm.generated(k)  # keys[0] is still generating
    adm.on_commit({0: 0})
    adm.observe(version(1, 8))
    assert not adm.can_admit()  # the window may not move past the straggler's
    adm.generated(keys[0])
    assert adm.can_admit()


def test_kafka_view_counts_other_actors_and_dead_letters() -> None:
    adm = Admission.for_config("pipeline", 0, 8, 4)  # B = 8
    adm.observe(version(3, 100))
    # 25 problems committed by the group in two partitions, 1 of them dead-lettered: 96 samples.
    adm.update_view(GroupView(committed={0: 10, 1: 15}, low={0: 0, 1: 0}, dlq=1, members=1))
    assert adm.admitted_samples() == 96
    assert len(admit_all(adm, 15, partition=1)) == 3  # 96 + 12 <= 100 + 8
    # With two live actors, each counts the other's uncommitted problems as many as its own.
    adm.update_view(GroupView(committed={0: 10, 1: 15}, low={0: 0, 1: 0}, dlq=1, members=2))
    assert adm.admitted_samples() == 96 + 2 * 12
    # A revoked partition's problems are the next owner's to count.
    adm.forget_partitions([1])
    assert adm.admitted_samples() == 96


def test_restart_resumes_from_committed_offsets() -> None:
    adm = Admission.for_config("pipeline", 1, 8, 4)
    adm.update_view(GroupView(committed={0: 6}, low={0: 0}, dlq=0, members=1))
    adm.observe(version(1, 8))  # 24 samples admitted before, 8 trained: 16 in flight = B
    assert not adm.can_admit()
    adm.observe(version(2, 16))
    assert len(admit_all(adm, 6)) == 2


@pytest.mark.parametrize(
    "mode,max_lag", [("pipeline", 0), ("pipeline", 1), ("pipeline", 3), ("conventional", 2)]
)
def test_simulated_pipeline_never_exceeds_max_lag(mode: str, max_lag: int) -> None:
    """An event simulation: groups take random times to generate and reach the trainer in the
    order they finish (overtaking while generating); the trainer steps every S samples."""
    S, g = 12, 4
    rng = random.Random(max_lag)
    adm = Admission.for_config(mode, max_lag, S, g)
    v, consumed = 0, 0
    adm.observe(version(0, 0))
    generating: dict[tuple[int, int], tuple[int, int]] = {}  # key -> (finish time, sampled version)
    queue: list[int] = []  # sampled versions of samples waiting for the trainer, in arrival order
    next_offset, lags = 0, []
    for t in range(3000):
        while adm.can_admit():
            key = (0, next_offset)
            next_offset += 1
            adm.admit(key)
            generating[key] = (t + rng.randint(1, 40), v)
        for key, (done_at, sampled) in sorted(generating.items(), key=lambda kv: kv[1][0]):
            if done_at <= t:
                del generating[key]
                adm.generated(key)
                queue.extend([sampled] * g)
        adm.on_commit({0: min(generating, default=(0, next_offset))[1]})
        while len(queue) >= S:  # one optimizer step with weights v
            batch, queue = queue[:S], queue[S:]
            lags.extend(v - sampled for sampled in batch)
            consumed += S
            v += 1
            adm.observe(version(v, consumed))
    expected = 0 if mode == "conventional" else max_lag
    assert v > 50 and max(lags) == expected


@pytest.mark.parametrize("guard", [True, False])
def test_a_ten_times_longer_straggler(guard: bool) -> None:
    """Groups generate in 4 ticks, one every 10 takes 40. With the guard every token is trained
    within max_lag versions, but while a straggler generates the servers hold little else; without
    it the servers stay full and the lag bound holds for each sample's last tokens, a straggler's
    first tokens being older by the versions it generated through."""
    S, g, L = 16, 4, 1
    adm = Admission.for_config("pipeline", L, S, g, straggler_guard=guard)
    v, consumed = 0, 0
    adm.observe(version(0, 0))
    generating: dict[tuple[int, int], tuple[int, int]] = {}  # key -> (finish time, first version)
    queue: list[tuple[int, int]] = []  # (first-token version, last-token version) per sample
    next_offset = 0
    first_lags, last_lags, busy = [], [], []
    for t in range(2000):
        while adm.can_admit():
            key = (0, next_offset)
            adm.admit(key)
            generating[key] = (t + (40 if next_offset % 10 == 3 else 4), v)
            next_offset += 1
        busy.append(len(generating) * g)
        for key, (done_at, first) in sorted(generating.items(), key=lambda kv: kv[1][0]):
            if done_at <= t:
                del generating[key]
                adm.generated(key)
                queue.extend([(first, v)] * g)
        adm.on_commit({0: min(generating, default=(0, next_offset))[1]})
        while len(queue) >= S:
            batch, queue = queue[:S], queue[S:]
            first_lags += [v - first for first, _ in batch]
            last_lags += [v - last for _, last in batch]
            consumed += S
            v += 1
            adm.observe(version(v, consumed))
    occupancy = sum(busy) / len(busy) / admission_bound("pipeline", L, S, g)
    if guard:
        assert max(first_lags) == L
        assert occupancy < 0.6  # the window waits on every straggler
    else:
        assert max(last_lags) == L and max(first_lags) > L
        assert occupancy > 0.8  # the window moves on while stragglers generate
        assert sum(lag > L for lag in first_lags) / len(first_lags) < 0.15  # stragglers only
    assert v > 100


@pytest.mark.parametrize("max_lag", [1, 2])
def test_two_actors_share_the_bound_by_their_partitions(max_lag: int) -> None:
    """Two actors, two partitions of `problems` each, that never see each other's commits (the
    group-wide view is only refreshed every `refresh_s`): with R per partition from the trainer
    (`WeightVersion.consumed_by_partition`) each admits within its share, so the samples in flight
    never exceed B and every sample's *last* token is at most L versions old when trained (its
    version when it finished generating). Its first token is not bounded: one actor's straggler
    does not hold the other actor's window (the guard is per actor), as with `straggler_guard:
    false` (module docstring)."""
    S, g, parts = 16, 4, {"a": (0, 1), "b": (2, 3)}
    rng = random.Random(max_lag)
    actors = {}
    for name, owned in parts.items():
        adm = Admission.for_config("pipeline", max_lag, S, g)
        adm.update_view(
            GroupView(committed={}, low=dict.fromkeys(range(4), 0), dlq=0, members=2, dlq_by_partition={})
        )
        adm.set_owned(owned)
        actors[name] = adm
    v, consumed, by_partition = 0, 0, dict.fromkeys(range(4), 0)

    def publish() -> None:
        wv = replace(version(v, consumed), consumed_by_partition=dict(by_partition))
        assert wv.attributed
        for adm in actors.values():
            adm.observe(wv)

    publish()
    generating: dict[tuple[str, int, int], tuple[int, int]] = {}  # (actor, p, offset) -> (done at, version)
    next_offset = dict.fromkeys(range(4), 0)
    queue: list[tuple[int, int]] = []  # (sampled version, partition) of samples waiting for the trainer
    lags, in_flight = [], []
    for t in range(3000):
        for name, adm in actors.items():
            while adm.can_admit():
                p = min(parts[name], key=lambda q: next_offset[q])
                adm.admit((p, next_offset[p]))
                generating[(name, p, next_offset[p])] = (t + rng.randint(1, 40), v)
                next_offset[p] += 1
        for key, (done_at, _sampled) in sorted(generating.items(), key=lambda kv: kv[1][0]):
            if done_at <= t:
                del generating[key]
                actors[key[0]].generated(key[1:])
                queue.extend([(v, key[1])] * g)  # its last token: sampled with the newest weights
        for name, adm in actors.items():
            adm.on_commit(
                {
                    p: min((o for (n, q, o) in generating if n == name and q == p), default=next_offset[p])
                    for p in parts[name]
                }
            )
        in_flight.append(sum(next_offset.values()) * g - consumed)
        while len(queue) >= S:
            batch, queue = queue[:S], queue[S:]
            lags.extend(v - sampled for sampled, _p in batch)
            for _sampled, p in batch:
                by_partition[p] += 1
            consumed += S
            v += 1
            publish()
    bound = admission_bound("pipeline", max_lag, S, g)
    assert v > 50 and max(in_flight) <= bound and max(lags) <= max_lag, (max(in_flight), max(lags))


def test_two_actors_keep_the_group_wide_rule_for_a_lineage_without_partition_counts() -> None:
    adm = Admission.for_config("pipeline", 1, 8, 4)
    adm.update_view(
        GroupView(committed={0: 2, 1: 2}, low={0: 0, 1: 0}, dlq=0, members=2, dlq_by_partition={})
    )
    adm.set_owned([0])
    adm.observe(version(1, 16))  # consumed_by_partition empty: not attributed
    assert adm.by_partition is None and adm.admitted_samples() == 16  # both partitions' commits
    adm.observe(replace(version(2, 16), consumed_by_partition={0: 8, 1: 8}))
    assert adm.admitted_samples() == 8 and adm.in_flight_samples() == 0  # partition 0 only
    adm.dlq_written(0)
    assert adm.admitted_samples() == 4  # a dead-lettered problem yields no samples


def test_the_group_view_reads_only_the_dead_letters_written_since_the_last_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before, every view re-read the whole `problems.dlq` once it had grown: a run with many dead
    letters read them all again at each refresh."""
    from stream_rl.kafka import reader
    from stream_rl.kafka.dead_letters import DeadLetters
    from stream_rl.kafka.memory import MemoryTransport
    from stream_rl.kafka.transport import Message
    from stream_rl.stages.admission import read_group_view

    t = MemoryTransport()
    t.create_topics([("problems", 2, {}), ("problems.dlq", 1, {})])
    letters, producer = DeadLetters("actor", "problems.dlq"), t.producer("p")
    yielded: list[int] = []
    real = reader.read_to_end

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        for msg in real(*args, **kwargs):
            yielded.append(msg.offset)
            yield msg

    monkeypatch.setattr(reader, "read_to_end", counting)
    for offset in range(3):
        letters.write(producer, Message("problems", offset % 2, offset, None, b"x"), "bad")
    first = read_group_view(t, "problems", "problems.dlq", "actor")
    assert first.dlq == 3 and first.dlq_by_partition == {0: 2, 1: 1} and yielded == [0, 1, 2]
    again = read_group_view(t, "problems", "problems.dlq", "actor", previous=first)
    assert again.dlq_by_partition == {0: 2, 1: 1} and yielded == [0, 1, 2]  # nothing new: nothing read
    letters.write(producer, Message("problems", 1, 9, None, b"x"), "bad")
    later = read_group_view(t, "problems", "problems.dlq", "actor", previous=again)
    assert later.dlq == 4 and later.dlq_by_partition == {0: 2, 1: 2}
    assert yielded == [0, 1, 2, 3]  # only the new record
