"""Hanging transactions (stream_rl/kafka/hanging.py, deploy/kafka/AbortHangingTransactions.java)
on a real broker of the test's own. A hanging transaction is made the way a broker's halt can
leave one: a producer's transaction (records on `scored`, its group's offsets) is open when the
broker is killed, and the broker comes back without its transaction coordinator's log, so no
coordinator knows the transaction and no marker will ever end it. Read_committed readers then
stop before it and the group's committed offsets cannot be read, what the stall after a full
disk showed (docs/faults.md); `stream-rl hanging --abort` ends it. A transaction its coordinator
still counts as in progress is left alone, at any age."""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator

import confluent_kafka as ck
import pytest
from confluent_kafka.admin import AdminClient, OffsetSpec

from stream_rl.cli import main as cli_main
from stream_rl.common.ports import free_port
from stream_rl.config import KafkaConfig
from stream_rl.kafka.broker import LocalBroker
from stream_rl.kafka.confluent import KafkaTransport
from stream_rl.kafka.hanging import CHECK_AFTER_S, HangingWatch, held_back, run_scope
from stream_rl.kafka.topics import SCORED, TopicNames, apply_topics

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBroker]:
    b = LocalBroker(tmp_path_factory.mktemp("hanging") / "kafka", port=free_port())
    b.up(quiet=True)
    try:
        yield b
    finally:
        b.down(quiet=True)


def _ends(bootstrap: str, topic: str, partition: int) -> tuple[int, int]:
    """(last stable offset, log end), once the partition's leader answers (a restarted broker
    answers UNKNOWN_LEADER_EPOCH until it has caught up with its metadata)."""
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    tp = ck.TopicPartition(topic, partition)
    deadline = time.monotonic() + 60
    while True:
        try:
            return tuple(  # type: ignore[return-value]
                admin.list_offsets({tp: OffsetSpec.latest()}, isolation_level=level)[tp].result().offset
                for level in (ck.IsolationLevel.READ_COMMITTED, ck.IsolationLevel.READ_UNCOMMITTED)
            )
        except ck.KafkaException:  # UNKNOWN_LEADER_EPOCH is not marked retriable: asked again too
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


# What a group coordinator answers while it is not yet (or no longer) the group's: a restarted
# single node loads its coordinators, may resign them ~10 s later and load them again.
COORDINATOR_MOVING = (
    ck.KafkaError.NOT_COORDINATOR,
    ck.KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    ck.KafkaError.COORDINATOR_NOT_AVAILABLE,
)


def _committed(bootstrap: str, group: str, topic: str) -> int | str:
    """The group's committed offset on partition 0, as a read_committed client reads it, once the
    group's coordinator answers as such (asked again while it answers that it is not: a clean-clone
    run read "Broker: Not coordinator" right after the restart)."""
    consumer = ck.Consumer({"bootstrap.servers": bootstrap, "group.id": group, "log_level": 0})
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                return consumer.committed([ck.TopicPartition(topic, 0)], timeout=8)[0].offset
            except ck.KafkaException as exc:
                if exc.args[0].code() not in COORDINATOR_MOVING or time.monotonic() > deadline:
                    return exc.args[0].str()
            time.sleep(0.2)
    finally:
        consumer.close()


def _open_transaction(bootstrap: str, names: TopicNames, txn_id: str) -> ck.Producer:
    """A transaction left open: a record on scored[1] and the preprocessor group's offset 5 on
    scored[0], neither committed nor aborted."""
    scored = names[SCORED]
    group = ck.Consumer({"bootstrap.servers": bootstrap, "group.id": names.group("preprocessor")})
    producer = ck.Producer({"bootstrap.servers": bootstrap, "transactional.id": txn_id, "log_level": 0})
    producer.init_transactions(60)
    producer.begin_transaction()
    producer.produce(scored, b"never decided", partition=1)
    producer.flush(30)
    producer.send_offsets_to_transaction(
        [ck.TopicPartition(scored, 0, 5)], group.consumer_group_metadata(), 30
    )
    group.close()
    return producer


def _run_with_an_open_transaction(broker: LocalBroker, run: str) -> tuple[str, TopicNames, ck.Producer]:
    """(bootstrap, the run's names, the producer) after the run's topics were made and a
    transaction was left open on them (`_open_transaction`)."""
    state = broker.running()
    assert state is not None
    names = TopicNames(run=f"{run}{os.getpid()}")
    apply_topics(KafkaTransport(state.bootstrap), names)
    producer = _open_transaction(state.bootstrap, names, f"stream-rl.{names.run}.preprocessor.0")
    return state.bootstrap, names, producer


def _restart_without_the_coordinators_log(broker: LocalBroker) -> str:
    """The broker killed with the transaction open, and started again without its transaction
    coordinator's log; its new bootstrap."""
    pid = broker.running().pid  # type: ignore[union-attr]
    os.kill(pid, signal.SIGKILL)
    broker.down(quiet=True, timeout=10)  # reaps it
    logs = broker.data_dir / "kraft-logs"
    removed = sorted(p.name for p in logs.glob("__transaction_state-*"))
    assert removed, "no transaction coordinator log to remove"
    for path in logs.glob("__transaction_state-*"):
        shutil.rmtree(path)
    return broker.up(quiet=True).bootstrap


def _hanging(names: TopicNames, bootstrap: str, *extra: str) -> int:
    return cli_main(["hanging", "--run", names.run, "--bootstrap", bootstrap, "--min-age", "1", *extra])


def test_a_transaction_no_coordinator_knows_is_found_and_aborted(
    broker: LocalBroker, capsys: pytest.CaptureFixture[str]
) -> None:
    bootstrap, names, _producer = _run_with_an_open_transaction(broker, "hang")
    scored = names[SCORED]
    assert _ends(bootstrap, scored, 1) == (0, 1)
    bootstrap = _restart_without_the_coordinators_log(broker)
    # The fault: the record stays undecided and the group's offsets cannot be read.
    assert _ends(bootstrap, scored, 1) == (0, 1)
    assert (
        _committed(bootstrap, names.group("preprocessor"), scored)
        == "Failed to get committed offsets: Local: Timed out"
    )
    capsys.readouterr()

    assert _hanging(names, bootstrap) == 1
    out = capsys.readouterr().out
    assert f"hanging {scored} 1 producer" in out and ": would abort" in out
    assert "hanging __consumer_offsets " in out
    assert _ends(bootstrap, scored, 1) == (0, 1)  # only listed

    assert _hanging(names, bootstrap, "--abort") == 0
    out = capsys.readouterr().out
    assert f"hanging {scored} 1 producer" in out and out.count(": aborted") == 2, out
    assert f"run {names.run}: 2 open transactions, 2 hanging, 2 aborted" in out
    last_stable, end = _ends(bootstrap, scored, 1)
    assert last_stable == end == 2  # the record and the abort marker, decided
    assert _committed(bootstrap, names.group("preprocessor"), scored) == ck.OFFSET_INVALID  # aborted: none
    assert _hanging(names, bootstrap) == 0
    assert "0 hanging" in capsys.readouterr().out


def test_a_transaction_its_coordinator_counts_is_left_alone(
    broker: LocalBroker, capsys: pytest.CaptureFixture[str]
) -> None:
    bootstrap, names, producer = _run_with_an_open_transaction(broker, "live")
    time.sleep(1.5)  # older than --min-age 1
    assert _hanging(names, bootstrap, "--abort") == 0
    out = capsys.readouterr().out
    assert f"open {names[SCORED]} 1 producer" in out and "Ongoing" in out, out
    # (__consumer_offsets is shared: another test's transaction hanging there is left alone.)
    assert not [line for line in out.splitlines() if line.startswith(f"hanging stream-rl.{names.run}.")], out
    assert "aborted" not in out.split(f"run {names.run}:")[0], out
    assert _ends(bootstrap, names[SCORED], 1) == (0, 1)  # still open: its producer decides
    producer.commit_transaction(30)
    deadline = time.monotonic() + 30  # the commit marker follows the commit's return
    while _ends(bootstrap, names[SCORED], 1) != (2, 2):
        assert time.monotonic() < deadline, _ends(bootstrap, names[SCORED], 1)
        time.sleep(0.1)


def test_a_hang_on_one_partition_while_versions_come_is_found_by_the_launchers_watch(
    broker: LocalBroker,
) -> None:
    """The launcher's watch (`HangingWatch`) as the launcher drives it, on the real broker: weight
    versions keep coming for a while (the run goes on from scored's other partition), so only
    scored[1]'s last stable offset, held short of its end, tells; once held `CHECK_AFTER_S` the
    watch aborts it."""
    bootstrap, names, _producer = _run_with_an_open_transaction(broker, "part")
    bootstrap = _restart_without_the_coordinators_log(broker)
    scored = names[SCORED]
    kafka = KafkaTransport(bootstrap)
    held = held_back(scored, kafka.watermarks(scored), kafka.log_ends(scored))
    assert held == {(scored, 1): 0}  # the fault: scored[1] held at offset 0, scored[0] free
    topics, prefix = run_scope(names)
    said: list[str] = []
    watch = HangingWatch(KafkaConfig(), bootstrap, topics, prefix, said.append, min_age_s=1)
    watch.tick(0.0, 10, held)
    watch.tick(CHECK_AFTER_S - 1, 11, held)
    assert watch.checks == 0 and not watch.reason
    watch.tick(CHECK_AFTER_S, 12, held)
    watch.join(120)
    assert watch.reason == f"a last stable offset held for {CHECK_AFTER_S:.0f}s ({scored} 1 at 0)"
    assert watch.checks == 1 and len(watch.aborted) == 2, said  # scored[1] and the group's offsets
    assert any(line.startswith(f"hanging {scored} 1 producer") for line in watch.aborted), said
    assert _ends(bootstrap, scored, 1) == (2, 2)  # decided: the record and the abort marker
    assert held_back(scored, kafka.watermarks(scored), kafka.log_ends(scored)) == {}
