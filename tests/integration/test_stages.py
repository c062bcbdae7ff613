"""Each stage against a real broker: the loader's idempotence, consumer groups shared by two
verifiers and two actors, DLQs and scoring failures, and the preprocessor killed mid-group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import fakes.tasks  # noqa: F401 - registers the `unruly` task
import pytest
from fakes.inference import FakeServer, factory
from fakes.records import make_rollout, make_scored
from stage_helpers import (
    StageThread,
    assignments,
    count,
    make_config,
    publish_version,
    read,
    wait_for,
)

from stream_rl.config import dump_config
from stream_rl.contracts import PartialGroup, Problem, Rollout, ScoredRollout, TrainingBatch, Verdict
from stream_rl.kafka.confluent import KafkaTransport
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.topics import PROBLEMS, RAW_ROLLOUTS, SCORED, TRAINING_BATCHES, TopicNames
from stream_rl.stages import actor, loader, preprocessor, verifier

pytestmark = pytest.mark.integration
serde = default_serde()


def test_loader_writes_each_problem_once_per_epoch_and_is_idempotent(
    kafka: KafkaTransport, run_names: TopicNames, kafka_bootstrap: str
) -> None:
    config = make_config(run_names, kafka_bootstrap, loader={"epochs": 2, "seed": 3})
    first = loader.run(config)  # its own Kafka transport, from the config
    assert first.records_out == 16
    assert loader.run(config).records_out == 0  # re-run: nothing duplicated
    more = make_config(run_names, kafka_bootstrap, loader={"epochs": 3, "seed": 3})
    assert loader.run(more).records_out == 8  # only the new epoch
    msgs = read(kafka, run_names[PROBLEMS])
    problems = [serde.decode(m.value, Problem) for m in msgs]
    pairs = Counter((p.problem_id, p.epoch) for p in problems)
    assert len(pairs) == 24 and set(pairs.values()) == {1}
    assert all(m.key.decode() == p.problem_id for m, p in zip(msgs, problems, strict=True))
    # The same seed gives the same order.
    epoch0 = [p.problem_id for p in sorted(problems, key=lambda p: p.created_ms) if p.epoch == 0]
    task_order = [
        p.problem_id
        for p in loader.plan(
            loader.get_task("arithmetic", {"num_problems": 8}).load_problems(run_names.run, 0), 1, 3
        )
    ]
    assert sorted(epoch0) == sorted(task_order)


def both_assigned(kafka: KafkaTransport, group: str) -> bool:
    members = assignments(kafka, group)
    return len(members) == 2 and all(members)


def test_two_verifiers_share_the_partitions_and_score_every_record_once(
    kafka: KafkaTransport, run_names: TopicNames, kafka_bootstrap: str
) -> None:
    config = make_config(run_names, kafka_bootstrap)
    threads = [StageThread(verifier.run, config, instance=i) for i in (0, 1)]
    for t in threads:
        t.start()
    try:
        wait_for(
            lambda: both_assigned(kafka, run_names.group("verifier")), what="two members with partitions"
        )
        p = kafka.producer("test-actor")
        rollouts = [
            make_rollout(i, k, group_size=4, run_id=run_names.run) for i in range(10) for k in range(4)
        ]
        for r in rollouts:
            p.produce(run_names[RAW_ROLLOUTS], serde.encode(r), key=r.group_id)
        p.flush()
        wait_for(lambda: count(kafka, run_names[SCORED]) >= 40, what="40 scored records")
    finally:
        stats = [t.finish() for t in threads]
    assert all(s.records_in > 0 for s in stats) and sum(s.records_in for s in stats) == 40
    scored = [serde.decode(m.value, ScoredRollout) for m in read(kafka, run_names[SCORED])]
    assert sorted(s.rollout.rollout_id for s in scored) == sorted(r.rollout_id for r in rollouts)
    assert {s.verifier_id for s in scored} == {"verifier-0", "verifier-1"}


def test_two_actors_share_the_partitions_and_sample_every_problem_once(
    kafka: KafkaTransport, run_names: TopicNames, kafka_bootstrap: str
) -> None:
    config = make_config(
        run_names, kafka_bootstrap, task={"name": "arithmetic", "params": {"num_problems": 12}}
    )
    servers = [FakeServer("http://fake-a"), FakeServer("http://fake-b")]
    publish_version(kafka, run_names, 0)
    threads = [StageThread(actor.run, config, instance=i, client_factory=factory(servers)) for i in (0, 1)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: both_assigned(kafka, run_names.group("actor")), what="two members with partitions")
        loader.run(config)
        wait_for(lambda: count(kafka, run_names[RAW_ROLLOUTS]) >= 48, what="48 rollouts")
    finally:
        stats = [t.finish() for t in threads]
    assert all(s.records_in > 0 for s in stats) and sum(s.records_in for s in stats) == 12
    out = [serde.decode(m.value, Rollout) for m in read(kafka, run_names[RAW_ROLLOUTS])]
    assert len(out) == 48 and len({r.rollout_id for r in out}) == 48
    assert Counter(r.group_id for r in out).most_common(1)[0][1] == 4
    assert {r.actor_id for r in out} == {"actor-0", "actor-1"}
    committed = kafka.group_offsets(run_names.group("actor"), run_names[PROBLEMS])
    assert sum(committed.values()) == 12


def test_bad_records_go_to_each_stages_dlq_and_scoring_failures_become_verdicts(
    kafka: KafkaTransport, run_names: TopicNames, kafka_bootstrap: str
) -> None:
    config = make_config(
        run_names, kafka_bootstrap, task={"name": "unruly"}, verifier={"workers": 1, "timeout_s": 0.5}
    )
    p = kafka.producer("test")
    for topic in (PROBLEMS, RAW_ROLLOUTS, SCORED):
        p.produce(run_names[topic], b"\x00garbage", key="bad")
    texts = ["raise", "hang", "5"]
    for k, text in enumerate(texts):
        r = make_rollout(0, k, group_size=3, run_id=run_names.run)
        r = replace(r, text=text, problem=replace(r.problem, task="unruly", answer="5"))
        p.produce(run_names[RAW_ROLLOUTS], serde.encode(r), key=r.group_id)
    p.flush()
    publish_version(kafka, run_names, 0)
    servers = [FakeServer("http://fake-a"), FakeServer("http://fake-b")]
    a = actor.run(config, client_factory=factory(servers), max_records=1, idle_timeout_s=10)
    v = verifier.run(config, max_records=4, idle_timeout_s=10)
    pre = preprocessor.run(config, max_records=4, idle_timeout_s=10)
    assert (a.dlq, v.dlq, pre.dlq) == (1, 1, 1)
    for topic in (PROBLEMS, RAW_ROLLOUTS, SCORED):
        [bad] = read(kafka, run_names.dlq(topic))
        assert bad.value == b"\x00garbage" and b"bad magic" in (bad.header("error") or b"")
    scored_msgs = [m for m in read(kafka, run_names[SCORED]) if m.key != b"bad"]
    scored = {s.rollout.text: s for s in (serde.decode(m.value, ScoredRollout) for m in scored_msgs)}
    assert scored["raise"].verdict is Verdict.ERROR and "ValueError" in scored["raise"].detail
    assert scored["hang"].verdict is Verdict.TIMEOUT and scored["hang"].reward == -1.0
    assert scored["5"].verdict is Verdict.CORRECT
    [batch] = [serde.decode(m.value, TrainingBatch) for m in read(kafka, run_names[TRAINING_BATCHES])]
    assert sorted(s.verdict.value for s in batch.samples) == ["correct", "error", "timeout"]


def latest_state(kafka: KafkaTransport, names: TopicNames) -> dict[str, PartialGroup | None]:
    out: dict[str, PartialGroup | None] = {}
    for m in read(kafka, names["preprocessor-state"]):
        out[m.key.decode()] = None if m.value is None else serde.decode(m.value, PartialGroup)
    return out


def test_preprocessor_killed_mid_group_restarts_and_emits_every_sample_exactly_once(
    kafka: KafkaTransport, run_names: TopicNames, kafka_bootstrap: str, tmp_path: Path
) -> None:
    n_groups, g = 30, 4
    config = make_config(run_names, kafka_bootstrap, preprocessor={"batch_size": 3})
    config_path = tmp_path / "run.yaml"
    config_path.write_text(dump_config(config))
    records = [
        make_scored(i, k, g, reward=float((i + k) % 2), run_id=run_names.run)
        for i in range(n_groups)
        for k in range(g)
    ]
    half = records[15 * g + 2 - 1]  # the 2nd sample of group 15: the group is half received
    producer = kafka.producer("test-verifier")

    def send(batch: list[ScoredRollout]) -> None:
        for s in batch:
            producer.produce(run_names[SCORED], serde.encode(s), key=s.rollout.group_id)
        producer.flush()

    cmd = [sys.executable, "-m", "stream_rl.cli", "preprocessor", "--config", str(config_path)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    batches_topic = run_names[TRAINING_BATCHES]

    def start() -> subprocess.Popen[str]:
        return subprocess.Popen(
            [*cmd, "--idle-timeout", "60"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )

    def kill(proc: subprocess.Popen[str]) -> None:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def half_group_is_open() -> bool:
        state = latest_state(kafka, run_names).get(half.rollout.group_id)
        return state is not None and not state.closed and len(state.samples) == 2

    # 1. Fifteen groups and half of the sixteenth; kill it once that half is in its state.
    send(records[: 15 * g + 2])
    proc = start()
    try:
        wait_for(half_group_is_open, what="the half group in the state topic")
    finally:
        kill(proc)
    # 2. The rest, with re-deliveries of samples already consumed (an at-least-once upstream);
    #    restarted, and killed again as soon as it makes progress (likely inside a transaction).
    send(records[15 * g + 2 :] + [records[3 * g], half, records[15 * g]])
    before = count(kafka, batches_topic)
    proc = start()
    try:
        wait_for(lambda: count(kafka, batches_topic) > before, what="progress after the restart")
    finally:
        kill(proc)
    # 3. Restarted once more: it finishes the input.
    res = subprocess.run([*cmd, "--idle-timeout", "3"], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    batches = [serde.decode(m.value, TrainingBatch) for m in read(kafka, batches_topic)]
    samples = [s for b in batches for s in b.samples]
    # Exactly once: every sample, none twice (duplicates and aborted transactions dropped).
    assert sorted(s.rollout_id for s in samples) == sorted(r.rollout.rollout_id for r in records)
    assert set(Counter(s.group_id for s in samples).values()) == {g}  # every group complete
    assert all(s is None or s.closed for s in latest_state(kafka, run_names).values())
