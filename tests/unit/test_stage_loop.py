"""The stage loop on the in-memory transport: outputs, commits, DLQ, transactions, bounds."""

from __future__ import annotations

import pytest
from fakes.records import make_problem, make_rollout

from stream_rl.contracts import Problem, Rollout
from stream_rl.errors import ContractError
from stream_rl.kafka.memory import MemoryTransport
from stream_rl.kafka.offsets import OffsetTracker
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.stage import Incoming, Output, Reject, StageLoop, StopFlag
from stream_rl.kafka.transport import Message

pytestmark = pytest.mark.unit

IN, OUT, DLQ = "in", "out", "in.dlq"


@pytest.fixture
def transport() -> MemoryTransport:
    t = MemoryTransport()
    t.create_topics([(IN, 2, {}), (OUT, 2, {}), (DLQ, 1, {})])
    return t


def produce_problems(t: MemoryTransport, n: int, garbage_at: tuple[int, ...] = ()) -> None:
    p = t.producer("test")
    for i in range(n):
        value = b"\x00garbage" if i in garbage_at else default_serde().encode(make_problem(i))
        p.produce(IN, value, key=f"k{i}")


def to_rollout(batch: list[Incoming[Problem]]) -> list[Output | Reject]:
    out: list[Output | Reject] = []
    for item in batch:
        if item.value.problem_id.endswith("13"):
            out.append(Reject(item, "problem 13 is unlucky"))
            continue
        r = make_rollout(int(item.value.problem_id.split("-")[1]))
        out.append(Output(OUT, r, key=r.group_id))
    return out


def loop(t: MemoryTransport, transactional: bool = False, **kw) -> StageLoop[Problem]:  # type: ignore[no-untyped-def]
    return StageLoop(
        name="test-stage",
        transport=t,
        group="g",
        input_topic=IN,
        input_type=Problem,
        handle=to_rollout,
        dlq_topic=DLQ,
        transactional_id="tx-1" if transactional else None,
        batch_size=4,
        poll_timeout_s=0.01,
        **kw,
    )


def decoded_outputs(t: MemoryTransport) -> list[Rollout]:
    return [default_serde().decode(m.value, Rollout) for m in t.messages(OUT)]


@pytest.mark.parametrize("transactional", [False, True])
def test_processes_every_record_and_commits(transport: MemoryTransport, transactional: bool) -> None:
    produce_problems(transport, 20, garbage_at=(5,))
    stats = loop(transport, transactional).run(idle_timeout_s=0.05)
    assert stats.stopped_by == "idle_timeout"
    assert stats.records_in == 20
    assert stats.dlq == 2  # the garbage record and the rejected one
    outs = decoded_outputs(transport)
    assert sorted(r.problem.problem_id for r in outs) == sorted(
        f"arith-{i:06d}" for i in range(20) if i not in (5, 13)
    )
    committed = transport.group_offsets("g", IN)
    assert sum(committed.values()) == 20


def test_dlq_records_keep_bytes_and_carry_the_error(transport: MemoryTransport) -> None:
    produce_problems(transport, 3, garbage_at=(1,))
    loop(transport).run(idle_timeout_s=0.05)
    [bad] = transport.messages(DLQ)
    assert bad.value == b"\x00garbage"
    assert bad.key == b"k1"
    assert b"bad magic" in (bad.header("error") or b"")
    assert bad.header("original.topic") == IN.encode()
    assert bad.header("error.stage") == b"test-stage"


def test_max_records_bounds_the_run(transport: MemoryTransport) -> None:
    produce_problems(transport, 10)
    stats = loop(transport).run(max_records=6)
    assert stats.stopped_by == "max_records"
    assert stats.records_in == 6
    assert sum(transport.group_offsets("g", IN).values()) == 6
    # A second run resumes from the committed offsets.
    stats2 = loop(transport).run(idle_timeout_s=0.05)
    assert stats2.records_in == 4
    assert len(transport.messages(OUT)) == 10


def test_failed_transaction_leaves_nothing_and_commits_nothing(transport: MemoryTransport) -> None:
    produce_problems(transport, 4)

    def explode(batch: list[Incoming[Problem]]) -> list[Output | Reject]:
        outs = to_rollout(batch)
        raise RuntimeError(f"crash after {len(outs)} outputs")

    stage = StageLoop(
        name="s",
        transport=transport,
        group="g",
        input_topic=IN,
        input_type=Problem,
        handle=explode,
        dlq_topic=DLQ,
        transactional_id="tx",
        poll_timeout_s=0.01,
    )
    with pytest.raises(RuntimeError, match="crash after"):
        stage.run(idle_timeout_s=0.05)
    assert transport.messages(OUT) == []
    assert sum(max(o, 0) for o in transport.group_offsets("g", IN).values()) == 0
    # Restarted with a working handler, every record is processed exactly once.
    loop(transport, transactional=True).run(idle_timeout_s=0.05)
    assert len(transport.messages(OUT)) == 4


def test_invalid_output_is_a_bug_not_bad_input(transport: MemoryTransport) -> None:
    produce_problems(transport, 1)

    def bad_output(batch: list[Incoming[Problem]]) -> list[Output | Reject]:
        r = make_rollout()
        r.logprobs = []
        return [Output(OUT, r)]

    stage = StageLoop(
        name="s",
        transport=transport,
        group="g",
        input_topic=IN,
        input_type=Problem,
        handle=bad_output,
        dlq_topic=DLQ,
        poll_timeout_s=0.01,
    )
    with pytest.raises(ContractError, match="produced an invalid"):
        stage.run(idle_timeout_s=0.05)
    assert transport.group_offsets("g", IN) == {0: -1, 1: -1}


def test_stop_flag_drains_and_stops(transport: MemoryTransport) -> None:
    produce_problems(transport, 8)
    stop = StopFlag()
    seen: list[int] = []

    def handle(batch: list[Incoming[Problem]]) -> list[Output | Reject]:
        seen.extend(1 for _ in batch)
        stop.set("test stop")
        return to_rollout(batch)

    stage = StageLoop(
        name="s",
        transport=transport,
        group="g",
        input_topic=IN,
        input_type=Problem,
        handle=handle,
        dlq_topic=DLQ,
        batch_size=3,
        poll_timeout_s=0.01,
        stop=stop,
    )
    stats = stage.run()
    assert stats.stopped_by == "test stop"
    assert len(seen) == 3  # the batch in hand was finished...
    assert sum(max(o, 0) for o in transport.group_offsets("g", IN).values()) == 3  # ...and committed


def test_two_members_split_partitions(transport: MemoryTransport) -> None:
    c1 = transport.consumer("grp", "c1")
    c2 = transport.consumer("grp", "c2")
    c1.subscribe([IN])
    c2.subscribe([IN])
    c1.poll_batch(1, 0.0)
    c2.poll_batch(1, 0.0)
    assert sorted(c1.assignment() + c2.assignment()) == [(IN, 0), (IN, 1)]
    c2.close()
    c1.poll_batch(1, 0.0)
    assert sorted(c1.assignment()) == [(IN, 0), (IN, 1)]


def msg(p: int, off: int) -> Message:
    return Message("t", p, off, None, b"")


def test_offset_tracker_commits_only_the_done_prefix() -> None:
    tr = OffsetTracker()
    for off in (10, 11, 13, 14):  # 12 is a transaction marker: never delivered
        tr.started(msg(0, off))
    tr.done(msg(0, 11))
    assert tr.committable() == {}
    tr.done(msg(0, 10))
    assert tr.committable() == {("t", 0): 12}
    tr.done(msg(0, 14))
    assert tr.committable() == {}
    assert tr.in_flight() == 1
    tr.done(msg(0, 13))
    assert tr.committable() == {("t", 0): 15}
    with pytest.raises(Exception, match="never started"):
        tr.done(msg(1, 0))
