"""The actor on the in-memory transport with fake inference servers."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import replace

import pytest
from fakes.inference import END, FakeServer, FakeTokenizer, factory, render

from stream_rl.config import RunConfig
from stream_rl.contracts import Problem, Rollout
from stream_rl.kafka.memory import MemoryTransport
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.stage import StopFlag
from stream_rl.kafka.topics import PROBLEMS, RAW_ROLLOUTS, WEIGHT_VERSIONS, TopicNames
from stream_rl.stages import actor, loader
from stream_rl.stages.rollouts import sample_seed
from stream_rl.tasks.guessing import score_guessing
from stream_rl.testing import make_problem, make_weight_version

pytestmark = pytest.mark.unit


def make_config(**over: object) -> RunConfig:
    data: dict = {  # type: ignore[type-arg]
        "run": "r",
        "task": {"name": "arithmetic", "params": {"num_problems": 6}},
        "actor": {"group_size": 4, "max_lag": 1, "backoff_s": 0.001, "dead_cooldown_s": 0.01},
        "trainer": {"samples_per_step": 64},
        "inference": {"servers": [{"url": "http://a"}, {"url": "http://b"}]},
    }
    for key, value in over.items():
        section, _, field = key.partition("__")
        if field:
            data.setdefault(section, {})[field] = value
        else:
            data[section] = value
    return RunConfig.model_validate(data)


def setup(config: RunConfig) -> tuple[MemoryTransport, TopicNames]:
    t = MemoryTransport()
    names = TopicNames(config.run)
    t.create_topics(names.all_topics(partitions=2))
    loader.run(config, transport=t)
    return t, names


def publish(
    t: MemoryTransport,
    names: TopicNames,
    v: int,
    consumed: int,
    updated: tuple[str, ...] = ("http://a", "http://b"),
) -> None:
    wv = replace(
        make_weight_version(v, run_id="r"),
        samples_trained=consumed,
        samples_filtered=0,
        servers_updated=list(updated),
    )
    t.producer("trainer").produce(names[WEIGHT_VERSIONS], default_serde().encode(wv), key="r")


def rollouts(t: MemoryTransport, names: TopicNames) -> list[Rollout]:
    return [default_serde().decode(m.value, Rollout) for m in t.messages(names[RAW_ROLLOUTS])]


def test_each_problem_becomes_a_group_of_rollouts_and_offsets_are_committed() -> None:
    config = make_config()
    t, names = setup(config)
    publish(t, names, 0, 0)
    servers = [FakeServer("http://a", version=0), FakeServer("http://b", version=0)]
    stats = actor.run(config, transport=t, client_factory=factory(servers), max_records=6, idle_timeout_s=5)
    assert stats.records_in == 6 and stats.records_out == 24 and stats.dlq == 0
    out = rollouts(t, names)
    groups: dict[str, list[Rollout]] = {}
    for r in out:
        groups.setdefault(r.group_id, []).append(r)
    problems = {m.key.decode() for m in t.messages(names[PROBLEMS])}
    assert {gid.rsplit(".e", 1)[0] for gid in groups} == problems
    for gid, rs in groups.items():
        assert sorted(r.sample_index for r in rs) == [0, 1, 2, 3]
        for r in rs:
            assert r.rollout_id == f"{gid}.s{r.sample_index}" and r.group_size == 4
            assert r.prompt_token_ids == render([m.to_dict() for m in r.problem.prompt])
            assert r.completion_token_ids == [*map(ord, r.text), END]
            assert len(r.logprobs) == len(r.completion_token_ids) and r.completion_mask is None
            assert [s.version for s in r.version_spans] == [0] and r.server_id in ("http://a", "http://b")
    # Keyed by group id, so a group never spans partitions.
    msgs = t.messages(names[RAW_ROLLOUTS])
    assert all(m.key.decode() == default_serde().decode(m.value, Rollout).group_id for m in msgs)
    assert len({(m.key, m.partition) for m in msgs}) == len(groups)
    # One request per group (n = group_size), seeded stably per group; load spread over both servers.
    assert sorted(s for srv in servers for s in srv.seeds) == sorted(sample_seed(0, gid) for gid in groups)
    assert all(srv.calls > 0 for srv in servers)
    committed = t.group_offsets(names.group("actor"), names[PROBLEMS])
    ends = {p: hi for p, (_lo, hi) in t.watermarks(names[PROBLEMS]).items()}
    assert committed == ends


def test_bad_problems_go_to_the_dlq() -> None:
    config = make_config(task__params={"num_problems": 2})
    t, names = setup(config)
    p = t.producer("x")
    p.produce(names[PROBLEMS], b"junk", key="junk")
    p.produce(names[PROBLEMS], default_serde().encode(make_problem(1, run_id="r")), key="other")
    bad = replace(make_problem(2, run_id="r"), task="guessing")
    p.produce(names[PROBLEMS], default_serde().encode(bad), key="guess")
    publish(t, names, 0, 0)
    servers = [FakeServer("http://a"), FakeServer("http://b")]
    stats = actor.run(config, transport=t, client_factory=factory(servers), max_records=5, idle_timeout_s=5)
    dlq = t.messages(names.dlq(PROBLEMS))
    assert stats.dlq == 2 and sorted(m.key for m in dlq) == [b"guess", b"junk"]
    assert b"bad magic" in (dlq[0].header("error") or b"") + (dlq[1].header("error") or b"")
    assert len(rollouts(t, names)) == 4 * 3  # arithmetic problems, including the foreign-looking one


def test_a_problem_every_server_rejects_is_dead_lettered_the_others_go_on() -> None:
    config = make_config(task__params={"num_problems": 5}, actor__max_retries=1)
    t, names = setup(config)
    publish(t, names, 0, 0)
    first = default_serde().decode(t.messages(names[PROBLEMS])[0].value, Problem)
    content = first.prompt[-1].content
    servers = [FakeServer("http://a", reject={content}), FakeServer("http://b", reject={content})]
    stats = actor.run(config, transport=t, client_factory=factory(servers), max_records=5, idle_timeout_s=5)
    assert stats.dlq == 1 and stats.records_out == 16
    [dead] = t.messages(names.dlq(PROBLEMS))
    assert b"prompt rejected" in (dead.header("error") or b"")
    assert first.problem_id not in {r.problem.problem_id for r in rollouts(t, names)}


def run_in_thread(config: RunConfig, t: MemoryTransport, servers: list[FakeServer], **kw):  # type: ignore[no-untyped-def]
    stop = StopFlag()
    result: dict = {}  # type: ignore[type-arg]

    def target() -> None:
        result["stats"] = actor.run(config, transport=t, client_factory=factory(servers), stop=stop, **kw)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return stop, thread, result


def wait_until(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_conventional_mode_samples_one_step_per_version_and_waits() -> None:
    config = make_config(mode="conventional", trainer__samples_per_step=8)
    t, names = setup(config)
    servers = [FakeServer("http://a"), FakeServer("http://b")]
    stop, thread, _ = run_in_thread(config, t, servers)
    try:
        time.sleep(0.3)  # nothing may happen before version 0: no condition to await
        assert rollouts(t, names) == []
        publish(t, names, 0, 0)
        wait_until(lambda: len(rollouts(t, names)) == 8)
        time.sleep(0.3)  # and nothing more until the trainer has used them
        assert len(rollouts(t, names)) == 8
        for s in servers:
            s.version = 1
        publish(t, names, 1, 8)
        wait_until(lambda: len(rollouts(t, names)) == 16)
        versions = Counter(r.version_spans[0].version for r in rollouts(t, names))
        assert versions == {0: 8, 1: 8}
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()


def test_sigterm_drains_groups_in_flight() -> None:
    config = make_config()
    t, names = setup(config)
    publish(t, names, 0, 0)
    servers = [FakeServer("http://a", latency_s=0.2), FakeServer("http://b", latency_s=0.2)]
    stop, thread, result = run_in_thread(config, t, servers)
    wait_until(lambda: sum(s.in_flight for s in servers) > 0)
    stop.set("received SIGTERM")
    thread.join(10)
    stats = result["stats"]
    assert stats.stopped_by == "received SIGTERM"
    out = rollouts(t, names)
    assert out and len(out) % 4 == 0  # whole groups only
    committed = sum(max(o, 0) for o in t.group_offsets(names.group("actor"), names[PROBLEMS]).values())
    assert committed == len(out) // 4  # every produced group's problem committed, nothing more


def test_multi_turn_rollouts_stay_on_one_server_and_carry_the_game_text() -> None:
    config = make_config(
        task={"name": "guessing", "params": {"max_number": 16, "max_turns": 3, "num_problems": 3}},
        actor__group_size=2,
    )
    t, names = setup(config)
    publish(t, names, 0, 0)
    servers = [FakeServer("http://a", version=5), FakeServer("http://b", version=9)]
    stats = actor.run(
        config,
        transport=t,
        client_factory=factory(servers),
        tokenizer=FakeTokenizer(),
        max_records=3,
        idle_timeout_s=5,
    )
    out = rollouts(t, names)
    assert stats.records_out == 6 and len(out) == 6
    server_version = {"http://a": 5, "http://b": 9}
    for r in out:
        assert {s.version for s in r.version_spans} == {server_version[r.server_id]}
        assert r.num_turns >= 1 and r.completion_mask is not None and not all(r.completion_mask)
        assert "[game over:" in r.text and score_guessing(r.text).verdict.value in ("wrong", "correct")
    assert Counter(r.server_id for r in out).keys() == {"http://a", "http://b"}
