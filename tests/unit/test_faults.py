"""Issue 15's data faults: every number on every contract validated, a sample trained at most once
whatever arrives (duplicate batches, duplicate rollouts, across a restart), non-finite losses and
gradients never applied, bad scored records to the DLQ, and the launcher's progress watchdog."""

from __future__ import annotations

import dataclasses
import math
import os
import signal
from pathlib import Path

import pytest
import torch
from fakes.training import (
    FakePusher,
    make_batches,
    make_tiny_model,
    produce_batches,
    setup_topics,
    stage_config,
)

from stream_rl.contracts import ScoredRollout, TrainingBatch, VersionSpan, WeightVersion, WeightVersionKind
from stream_rl.errors import ContractError
from stream_rl.kafka.memory import MemoryTransport
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.topics import WEIGHT_VERSIONS
from stream_rl.run.watchdog import Sample, Watchdog
from stream_rl.stages import trainer as trainer_stage
from stream_rl.train.dedupe import TrainedIds

pytestmark = pytest.mark.unit
SERDE = default_serde()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


# -- contracts ---------------------------------------------------------------------------------


def _batch() -> TrainingBatch:
    return make_batches(1, 2, seed=3)[0]


@pytest.mark.parametrize(
    "change",
    [
        lambda s: dataclasses.replace(s, advantages=[math.nan] * len(s.advantages)),
        lambda s: dataclasses.replace(s, advantages=[math.inf] * len(s.advantages)),
        lambda s: dataclasses.replace(s, behaviour_logprobs=[0.5] * len(s.behaviour_logprobs)),
        lambda s: dataclasses.replace(s, behaviour_logprobs=[-math.inf] * len(s.behaviour_logprobs)),
        lambda s: dataclasses.replace(s, reward=math.inf),
        lambda s: dataclasses.replace(s, version_spans=[VersionSpan(-1, 0)]),
    ],
    ids=[
        "nan-advantage",
        "inf-advantage",
        "positive-logprob",
        "inf-logprob",
        "inf-reward",
        "negative-version",
    ],
)
def test_training_samples_with_bad_numbers_are_refused(change) -> None:  # type: ignore[no-untyped-def]
    batch = _batch()
    bad = dataclasses.replace(batch, samples=[change(batch.samples[0]), *batch.samples[1:]])
    with pytest.raises(ContractError):
        SERDE.encode(bad)


def test_rewards_and_logprobs_of_scored_rollouts_are_checked() -> None:
    from fakes.records import make_scored

    good = make_scored()
    SERDE.decode(SERDE.encode(good), ScoredRollout)
    for reward in (math.inf, -math.inf, math.nan, 1e300):
        with pytest.raises(ContractError, match="reward"):
            SERDE.encode(dataclasses.replace(good, reward=reward))
    rollout = dataclasses.replace(good.rollout, logprobs=[0.1] * len(good.rollout.logprobs))
    with pytest.raises(ContractError, match="logprob"):
        SERDE.encode(dataclasses.replace(good, rollout=rollout))
    with pytest.raises(ContractError, match="step is negative"):
        WeightVersion("r", 1, -1, WeightVersionKind.UPDATE, 0, 0, "c").validate()


# -- at most once --------------------------------------------------------------------------------


def test_trained_ids_drop_duplicate_batches_and_rollouts(tmp_path: Path) -> None:
    a, b = make_batches(2, 2, seed=4)
    ids = TrainedIds(capacity=100)
    assert ids.filter(a) == (a, 0)
    assert ids.filter(a) == (None, 2)  # the same batch again
    mixed = dataclasses.replace(b, samples=[a.samples[0], b.samples[0]])
    kept, dropped = ids.filter(mixed)
    assert (
        dropped == 1
        and kept is not None
        and [s.rollout_id for s in kept.samples] == [b.samples[0].rollout_id]
    )
    # A step abandoned (SIGTERM) leaves nothing in a checkpoint; a step taken does.
    ids.save(tmp_path)
    assert TrainedIds.load(tmp_path, 100).filter(a) == (a, 0)
    ids.step_taken()
    ids.save(tmp_path)
    assert TrainedIds.load(tmp_path, 100).filter(a) == (None, 2)
    # Bounded memory: only the last `capacity` ids are kept.
    small = TrainedIds(capacity=2)
    for batch in make_batches(3, 2, seed=5):
        small.filter(batch)
        small.step_taken()
    assert len(small.samples) == 2


def test_a_duplicated_batch_and_rollout_are_trained_once_even_across_a_restart(
    tmp_path: Path, model_dir: Path
) -> None:
    transport = MemoryTransport()
    b = make_batches(6, 2, seed=6)
    dup_rollout = dataclasses.replace(b[3], batch_id="other", samples=[b[0].samples[0]])
    # Steps of 4 samples: b0 b1 | b1 again, b0's first sample in another batch, b2 b3.
    names = setup_topics(transport, "r1", [b[0], b[1], b[1], dup_rollout, b[2], b[3]])
    cfg = stage_config(tmp_path, model_dir)
    first = trainer_stage.run(cfg, transport, pusher=FakePusher(), max_steps=2, idle_timeout_s=1)
    assert first.version == 2 and first.duplicates == 3
    produce_batches(transport, names, [b[0], b[3], b[4], b[5]])  # re-delivered after the restart
    second = trainer_stage.run(cfg, transport, pusher=FakePusher(), max_steps=3, idle_timeout_s=1)
    assert second.version == 3 and second.duplicates == 4  # the checkpoint remembered b0 and b3
    wvs = [SERDE.decode(m.value, WeightVersion) for m in transport.messages(names.topic(WEIGHT_VERSIONS))]
    assert [w.samples_trained for w in wvs] == [0, 4, 8, 12]
    assert wvs[2].metrics["duplicates"] == 3 and wvs[3].metrics["duplicates"] == 4


# -- non-finite ----------------------------------------------------------------------------------


def test_a_non_finite_loss_or_gradient_is_never_applied(tmp_path: Path, model_dir: Path) -> None:
    from stream_rl.train.backends import build_trainer

    cfg = stage_config(tmp_path, model_dir)
    trainer = build_trainer(cfg)
    samples = make_batches(1, 2, seed=7)[0].samples
    before = trainer.checksum()
    head = trainer.model.get_output_embeddings().weight  # type: ignore[attr-defined]
    saved = head.detach().clone()
    with torch.no_grad():
        head[0, 0] = math.nan  # the loss becomes NaN: not back-propagated
    result = trainer.micro_batch(samples)
    assert not result.finite and all(p.grad is None for p in trainer.model.parameters())  # type: ignore[attr-defined]
    with torch.no_grad():
        head.copy_(saved)
    assert trainer.checksum() == before
    handle = head.register_hook(lambda g: g * math.inf)  # a finite loss, a non-finite gradient
    assert trainer.micro_batch(samples).finite
    outcome = trainer.optimizer_step(2)
    handle.remove()
    assert outcome.skipped and trainer.checksum() == before  # weights untouched


# -- bad scored records --------------------------------------------------------------------------


def test_scored_records_of_another_task_go_to_the_dlq() -> None:
    from test_preprocessor import groups, make_config, produce, trained, transport

    from stream_rl.stages import preprocessor

    t = transport()
    records = groups(2)
    rollout = records[0].rollout
    foreign = dataclasses.replace(
        records[0],
        rollout=dataclasses.replace(rollout, problem=dataclasses.replace(rollout.problem, task="guessing")),
    )
    produce(t, [foreign, *records])
    stats = preprocessor.run(make_config(), transport=t, max_records=9, idle_timeout_s=2)
    samples, _ = trained(t)
    assert stats.dlq == 1 and len(samples) == 8


# -- watchdog ------------------------------------------------------------------------------------


def test_the_watchdog_names_the_stuck_stage() -> None:
    dog = Watchdog(timeout_s=10)
    dog.observe(
        0, Sample(3, {"loader": 40, "actor": 20, "verifier": 20, "preprocessor": 10}, {"verifier": 0})
    )
    assert dog.check(5) is None
    dog.observe(
        9, Sample(3, {"loader": 40, "actor": 30, "verifier": 20, "preprocessor": 10}, {"verifier": 10})
    )
    stall = dog.check(12)
    assert (
        stall is not None and stall.stage == "verifier" and "no new weight version for 12s" in stall.message
    )
    dog.observe(13, Sample(4, {"loader": 40}, {}))  # a new version: the clock restarts
    assert dog.check(20) is None
    dog.observe(30, Sample(4, {"loader": 40, "preprocessor": 50}, {}, untrained=30, step_offsets=5))
    stall = dog.check(30)
    assert stall is not None and stall.stage == "trainer"
    out = Watchdog(1)
    out.observe(0, Sample(7, {"loader": 40, "actor": 40}, {"actor": 0, "verifier": 0, "preprocessor": 0}))
    stall = out.check(2)
    assert stall is not None and stall.stage is None and "out of problems" in stall.message


# -- errors users meet ---------------------------------------------------------------------------


def test_unknown_task_missing_model_and_unreachable_kafka_are_one_line_errors(
    tmp_path: Path, model_dir: Path
) -> None:
    from stream_rl.common.ports import free_port
    from stream_rl.config import RunConfig
    from stream_rl.errors import StreamRLError
    from stream_rl.kafka.confluent import check_reachable
    from stream_rl.kafka.stage import StopFlag
    from stream_rl.run.launch import Launcher

    def check(**cfg: object) -> str:
        config = RunConfig.model_validate(
            {"runs_dir": str(tmp_path), "model": {"path": str(model_dir)}, **cfg}
        )
        with pytest.raises(StreamRLError) as info:
            Launcher(config, StopFlag()).check_config()
        return str(info.value)

    assert check(task={"name": "nosuchtask"}).startswith("task.name: unknown task 'nosuchtask'")
    assert "model.path" in check(model={"path": str(tmp_path / "none")})
    with pytest.raises(StreamRLError, match="no Kafka broker answers") as info:
        check_reachable(f"127.0.0.1:{free_port()}", timeout=1.0)
    assert "\n" not in str(info.value)


# -- epochs are epochs ---------------------------------------------------------------------------


def test_after_one_epoch_worth_of_problems_every_problem_was_taken_once() -> None:
    from fakes.inference import FakeServer, factory
    from test_actor import make_config as actor_config
    from test_actor import publish, rollouts

    from stream_rl.stages import actor, loader

    # One server that never makes a request wait: it is asked in the order problems are taken.
    config = actor_config(
        task__params={"num_problems": 12}, loader={"epochs": 3}, inference={"servers": [{"url": "http://a"}]}
    )
    t = MemoryTransport()
    names = __import__("stream_rl.kafka.topics", fromlist=["TopicNames"]).TopicNames(config.run)
    t.create_topics(names.all_topics(partitions=4))
    loader.run(config, transport=t)
    publish(t, names, 0, 0)
    publish(t, names, 1, 10_000)  # admission never holds
    servers = [FakeServer("http://a", version=0)]
    actor.run(config, transport=t, client_factory=factory(servers), max_records=36, idle_timeout_s=5)
    from stream_rl.stages.rollouts import sample_seed

    by_seed = {sample_seed(0, r.group_id): r.group_id for r in rollouts(t, names)}
    order = [by_seed[seed] for seed in servers[0].seeds]  # the order the server was asked
    assert len(order) == 36
    # The in-memory consumer hands over one partition at a time (as librdkafka's fetches do).
    for epoch in range(3):
        chunk = order[12 * epoch : 12 * (epoch + 1)]
        assert all(g.endswith(f".e{epoch}") for g in chunk), chunk
        assert len({g.rsplit(".e", 1)[0] for g in chunk}) == 12


def test_duplicate_problem_epoch_and_tombstones_are_dead_lettered() -> None:
    from fakes.inference import FakeServer, factory
    from test_actor import make_config as actor_config
    from test_actor import publish

    from stream_rl.kafka.topics import PROBLEMS, TopicNames
    from stream_rl.stages import actor, loader

    config = actor_config(task__params={"num_problems": 2})
    t = MemoryTransport()
    names = TopicNames(config.run)
    t.create_topics(names.all_topics(partitions=2))
    loader.run(config, transport=t)
    first = t.messages(names[PROBLEMS])[0]
    p = t.producer("bad")
    p.produce(names[PROBLEMS], first.value, key=first.key)  # the same (problem, epoch) again
    p.produce(names[PROBLEMS], None, key=first.key)  # a tombstone
    publish(t, names, 0, 0)
    servers = [FakeServer("http://a", version=0), FakeServer("http://b", version=0)]
    stats = actor.run(config, transport=t, client_factory=factory(servers), max_records=4, idle_timeout_s=5)
    assert stats.dlq == 2 and stats.extra["duplicates"] == 1 and stats.records_out == 2 * 4
    reasons = [m.header("error") or b"" for m in t.messages(names.dlq(PROBLEMS))]
    assert any(b"duplicate of" in r for r in reasons) and any(b"tombstone" in r for r in reasons)


def test_launched_servers_get_a_fresh_admin_token_that_never_reaches_the_run_dir(tmp_path: Path) -> None:
    from stream_rl.config import ADMIN_TOKEN_ENV, RunConfig, dump_config
    from stream_rl.kafka.stage import StopFlag
    from stream_rl.run.launch import Launcher, child_env

    config = RunConfig.model_validate({"runs_dir": str(tmp_path), "inference": {"admin_token": None}})
    first, second = Launcher(config, StopFlag()), Launcher(config, StopFlag())
    assert first.admin_token and second.admin_token and first.admin_token != second.admin_token
    assert child_env(config, first.admin_token)[ADMIN_TOKEN_ENV] == first.admin_token
    assert first.admin_token not in dump_config(config)
    external = RunConfig.model_validate(
        {"inference": {"servers": [{"url": "http://x"}], "admin_token": None}}
    )
    assert Launcher(external, StopFlag()).admin_token is None
    assert RunConfig().trainer.checkpoint_every > 0  # a killed trainer never re-trains from version 0


def test_a_scoring_worker_whose_verifier_died_exits_quietly() -> None:
    import multiprocessing

    from stream_rl.stages.scoring import _worker_main
    from stream_rl.tasks import get_task

    ours, theirs = multiprocessing.Pipe()
    theirs.close()  # the verifier was SIGKILLed: the pipe is broken
    # The worker ignores SIGINT and SIGTERM (its verifier owns its life); in this process that would
    # outlive the test (and, inherited through exec, the processes later tests start).
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        _worker_main(ours, get_task("arithmetic", {"num_problems": 2}))  # returns, no traceback
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


# -- a transaction aborted by a broker outage is redone ------------------------------------------


def test_a_transaction_aborted_by_an_outage_is_redone_from_the_batch_start() -> None:
    from test_stage_loop import IN, OUT, loop, produce_problems

    from stream_rl.errors import TransactionAborted

    t = MemoryTransport()
    t.create_topics([(IN, 2, {}), (OUT, 2, {}), ("in.dlq", 1, {})])
    produce_problems(t, 12)
    assigned: list[list[tuple[str, int]]] = []
    stage = loop(t, transactional=True, on_assign=assigned.append)
    commit = stage.producer.commit_transaction
    calls = {"n": 0}

    def flaky(timeout: float = 30.0) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # the second transaction: the broker went away mid-commit
            stage.producer.abort_transaction()
            raise TransactionAborted("commit_transaction: Broker: Not coordinator (transaction aborted)")
        commit(timeout)

    stage.producer.commit_transaction = flaky  # type: ignore[method-assign]
    stats = stage.run(max_records=16, idle_timeout_s=0.5)
    keys = sorted(m.key for m in t.messages(OUT))
    assert len(keys) == 12 and len(set(keys)) == 12  # nothing lost, nothing twice
    assert stats.extra["transactions_redone"] == 1 and len(assigned) >= 1


def test_the_admin_token_reaches_children_through_their_config_and_environment(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import yaml

    from stream_rl.config import ADMIN_TOKEN_ENV, RunConfig, dump_config

    text = dump_config(RunConfig.model_validate({"inference": {"admin_token": "s3cret"}}))
    assert "s3cret" not in text and "admin_token" not in text
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "s3cret")  # what the launcher puts in a child's environment
    child = RunConfig.model_validate(yaml.safe_load(text))
    assert (
        child.inference.admin_token is not None and child.inference.admin_token.get_secret_value() == "s3cret"
    )


def test_the_run_summary_line_survives_a_run_without_rewards(capsys) -> None:  # type: ignore[no-untyped-def]
    from stream_rl.run.launch import _print_summary

    _print_summary({"exit_reason": "stopped", "wall_s": None, "reward": {"first3_mean": None}}, Path("r"))
    assert "no version trained by this invocation" in capsys.readouterr().out
    trained = {"count": 2, "first": 1, "last": 2}
    _print_summary(
        {"exit_reason": "stopped", "versions": trained, "reward": {"first3_mean": None}}, Path("r")
    )
    assert "trained versions 1-2, reward - -> -" in capsys.readouterr().out


def test_a_transaction_call_that_never_returns_wedges_the_producer_instead_of_hanging(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import time as _time

    from stream_rl.kafka import confluent, librdkafka

    monkeypatch.setattr(librdkafka, "BOUNDED_GRACE_S", 0.2)
    producer = confluent.KafkaProducer("127.0.0.1:1", "wedge-test", transactional_id="tx-wedge")
    with pytest.raises(confluent.Wedged, match="did not return"):
        producer._transaction_step("commit_transaction", lambda t: _time.sleep(5), timeout=0.1)
    with pytest.raises(confluent.Wedged, match="wedged"):
        producer.abort_transaction()  # no conflicting second call: the stage exits and restarts


def test_closing_a_fenced_producer_does_not_raise_over_the_stages_error(caplog) -> None:  # type: ignore[no-untyped-def]
    """The hour under bench/nemesis.py: the preprocessor's producer was fenced during an abort (one
    line logged), then the stage's `finally` closed it and flush raised the fatal KafkaException:
    a traceback instead of the stage's error. Closing now logs a fatal error; others still raise."""
    import confluent_kafka as ck

    from stream_rl.kafka import confluent

    class Flush:
        def __init__(self, err: ck.KafkaError) -> None:
            self.err = err

        def flush(self, timeout: float) -> int:
            raise ck.KafkaException(self.err)

    producer = confluent.KafkaProducer("127.0.0.1:1", "fence-test", transactional_id="tx-fence")
    fenced = ck.KafkaError(
        ck.KafkaError._FENCED, "Failed to end transaction: fenced by a newer instance", fatal=True
    )
    producer._p = Flush(fenced)  # type: ignore[assignment]
    with caplog.at_level("WARNING", logger="stream_rl.kafka"):
        producer.close()
    assert "closed after a fatal error" in caplog.text and "fenced by a newer instance" in caplog.text
    producer._p = Flush(ck.KafkaError(ck.KafkaError._TIMED_OUT, "timed out"))  # type: ignore[assignment]
    with pytest.raises(ck.KafkaException):
        producer.close()


def test_free_ports_lie_below_the_ephemeral_range_and_are_free() -> None:
    # An outgoing connection's local port comes from the ephemeral range; a listening port picked
    # there could be taken between the pick and the bind (a server's `cannot bind`, seen in CI).
    import socket

    from stream_rl.common.ports import free_port, listen_range

    span = listen_range()
    assert span is not None  # Linux: /proc/sys/net/ipv4/ip_local_port_range
    for _ in range(20):
        port = free_port()
        assert span[0] <= port <= span[1]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_a_port_is_never_handed_out_twice_by_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launcher asks for its stages' metrics ports in one go, before any stage binds its own: two
    draws of one port met in a clean-clone run (actor-0 and actor-1 both given 13497). From a span
    of 4 ports, 4 draws cover it 10 times over (by chance: (4!/4^4)^10, 1e-10), and a fifth is
    refused in one line."""
    from stream_rl.common import ports

    low = 20000 + os.getpid() % 5000
    monkeypatch.setattr(ports, "listen_range", lambda: (low, low + 3))
    monkeypatch.setattr(ports.socket, "socket", _BindsAnything)
    for _ in range(10):
        monkeypatch.setattr(ports, "_GIVEN", ports.collections.deque(maxlen=4096))
        assert sorted(ports.free_port() for _ in range(4)) == list(range(low, low + 4))
    with pytest.raises(OSError, match="has not handed out already"):
        ports.free_port()


class _BindsAnything:
    """A socket whose bind always succeeds (the ports above may be in use on a shared machine), and
    whose bind to 0 gets a port already handed out (the fallback's draw)."""

    def __init__(self, *args: object) -> None:
        self.port = 0

    def __enter__(self) -> _BindsAnything:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def bind(self, address: tuple[str, int]) -> None:
        self.port = address[1] or 20000 + os.getpid() % 5000

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)


def test_a_port_freed_a_moment_later_is_waited_for_and_one_kept_is_refused() -> None:
    """LocalBroker.up's check of its port: a JVM killed with -9 counts as gone (its main thread a
    zombie) while its other threads still hold its listening socket for ~0.1 s."""
    import socket
    import threading

    from stream_rl.common.ports import free_port, port_frees

    port = free_port()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", port))
    listener.listen()
    assert not port_frees(port, "127.0.0.1", within_s=0.3)  # kept: refused once the wait is over
    closing = threading.Timer(0.3, listener.close)
    closing.start()
    assert port_frees(port, "127.0.0.1", within_s=10.0)  # freed meanwhile
    closing.join()


def test_a_flush_stuck_while_the_broker_answers_wedges_but_an_outage_is_waited_out() -> None:
    """`KafkaProducer.flush`'s judge: no acknowledgement for STUCK_S while the broker answers the
    producer's metadata requests is stuck (the stage restarts); while the broker does not answer it
    is an outage (waited out up to kafka.outage_timeout_s); any acknowledgement starts over."""
    from stream_rl.kafka.producer import STUCK_S, _StuckDelivery

    now = [0.0]
    broker_up = [False]
    asked: list[float] = []

    def answers() -> bool:
        asked.append(now[0])
        return broker_up[0]

    judge = _StuckDelivery(answers, clock=lambda: now[0])

    def run_until(t: float, remaining: int) -> bool:
        while now[0] < t:
            now[0] += 1.0
            if judge.check(remaining):
                return True
        return False

    assert not run_until(60, 16)  # the broker is down: an outage, however long
    assert asked and all(b - a >= 5.0 for a, b in zip(asked, asked[1:], strict=False))  # asked every 5 s
    broker_up[0] = True
    assert not run_until(60 + STUCK_S - 6, 16)
    assert not run_until(60 + STUCK_S + 10, 15)  # one record acknowledged: the clock starts over
    assert run_until(60 + 2 * STUCK_S + 20, 15)  # then nothing moved for STUCK_S, the broker answering


def test_children_get_glibcs_arena_cap_but_not_vllms_servers(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """MALLOC_ARENA_MAX=2 for the stages, the fork server and built-in servers (memory freed in a
    thread's own arena otherwise stayed: bench/rejoin_memory.py, docs/faults.md); a vLLM server is
    left to its own allocator; the launcher's own setting wins everywhere."""
    from stream_rl.config import RunConfig
    from stream_rl.run.children import FORK_SERVER, child_env

    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    builtin = RunConfig.model_validate({})
    vllm = RunConfig.model_validate({"inference": {"engine": "vllm"}})
    for role in ("actor", "trainer", "preprocessor", FORK_SERVER, "server"):
        assert child_env(builtin, role=role)["MALLOC_ARENA_MAX"] == "2", role
    assert child_env(vllm, role="actor")["MALLOC_ARENA_MAX"] == "2"
    assert "MALLOC_ARENA_MAX" not in child_env(vllm, role="server")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")
    assert child_env(builtin, role="actor")["MALLOC_ARENA_MAX"] == "8"
    assert child_env(vllm, role="server")["MALLOC_ARENA_MAX"] == "8"


def test_a_write_refused_at_produce_is_the_same_one_line_as_at_delivery() -> None:
    """librdkafka raises a refusal from produce() once it knows the topic is not allowed (a clean
    clone's secured-cluster test got the raw KafkaError there instead of the one line naming the
    principal and the right that a delivery report gives)."""
    import confluent_kafka as ck

    from stream_rl.errors import KafkaError
    from stream_rl.kafka import confluent

    class Refuses:
        def produce(self, topic: str, **kwargs: object) -> None:
            raise ck.KafkaException(
                ck.KafkaError(ck.KafkaError.TOPIC_AUTHORIZATION_FAILED, "Topic authorization failed")
            )

    producer = confluent.KafkaProducer("127.0.0.1:1", "refused-test")
    producer._p = Refuses()  # type: ignore[assignment]
    with pytest.raises(
        KafkaError, match=r"Kafka refused User:ANONYMOUS WRITE on topic t-b \(TOPIC_AUTHORIZATION_FAILED\)"
    ):
        producer.produce("t-b", b"x")
