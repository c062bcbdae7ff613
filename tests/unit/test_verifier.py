"""The scoring pool and the verifier stage on the in-memory transport."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace

import fakes.tasks  # noqa: F401 - registers the `unruly` task
import pytest
from fakes.records import make_problem, make_rollout

from stream_rl.config import RunConfig
from stream_rl.contracts import Rollout, ScoredRollout, Verdict
from stream_rl.kafka.memory import MemoryTransport
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.topics import RAW_ROLLOUTS, SCORED, TopicNames
from stream_rl.stages import verifier
from stream_rl.stages.scoring import ScoringPool
from stream_rl.tasks import get_task

pytestmark = pytest.mark.unit


def job(text: str, answer: str = "5"):  # type: ignore[no-untyped-def]
    return (replace(make_problem(0), answer=answer, task="unruly"), text, "stop")


def test_pool_turns_raises_hangs_and_crashes_into_verdicts_and_recovers() -> None:
    pool = ScoringPool(get_task("unruly"), workers=2, timeout_s=0.5)
    try:
        texts = ["5", "raise", "hang", "4", "crash", "5", "hang", "5"]
        scores = pool.score_many([job(t) for t in texts])
        verdicts = [s.verdict for s in scores]
        assert verdicts == [
            Verdict.CORRECT,
            Verdict.ERROR,
            Verdict.TIMEOUT,
            Verdict.WRONG,
            Verdict.ERROR,
            Verdict.CORRECT,
            Verdict.TIMEOUT,
            Verdict.CORRECT,
        ]
        assert "ValueError: the reward function broke" in scores[1].detail
        assert "died" in scores[4].detail and "longer than 0.5s" in scores[2].detail
        assert [s.reward for s in scores] == [1.0, -1.0, -1.0, 0.0, -1.0, 1.0, -1.0, 1.0]
        assert pool.restarts == 3  # two hung workers killed, one crashed worker replaced
        # The replaced workers score normally.
        assert [s.verdict for s in pool.score_many([job("5"), job("6")])] == [Verdict.CORRECT, Verdict.WRONG]
    finally:
        pool.close()


def test_workers_found_dead_while_idle_are_replaced_and_score_the_batch() -> None:
    """All workers dead between batches (before: `min() arg is an empty sequence` from the pool,
    when a SIGTERM to the verifier's process group had killed them): replaced, the jobs scored."""
    pool = ScoringPool(get_task("unruly"), workers=2, timeout_s=5.0)
    try:
        # Two jobs: both workers are started and ready (a worker killed before it said ready is
        # a failed start, a TaskError, not this case).
        assert [s.verdict for s in pool.score_many([job("5"), job("6")])] == [Verdict.CORRECT, Verdict.WRONG]
        assert all(w.ready for w in pool._workers)
        for worker in pool._workers:
            worker.process.kill()
            worker.process.join(5)
        assert [s.verdict for s in pool.score_many([job("5"), job("6")])] == [Verdict.CORRECT, Verdict.WRONG]
        assert pool.restarts == 2
    finally:
        pool.close()


def test_workers_outlive_a_sigterm_to_the_process_group() -> None:
    pool = ScoringPool(get_task("unruly"), workers=1, timeout_s=5.0)
    try:
        pool.score_many([job("5")])  # started and ready
        os.kill(pool._workers[0].process.pid, signal.SIGTERM)
        time.sleep(0.3)
        assert pool._workers[0].process.is_alive()
        assert [s.verdict for s in pool.score_many([job("5")])] == [Verdict.CORRECT] and pool.restarts == 0
    finally:
        pool.close()


def test_inline_scoring_turns_exceptions_into_errors() -> None:
    pool = ScoringPool(get_task("unruly"), workers=0, timeout_s=1.0)
    scores = pool.score_many([job("raise"), job("5")])
    assert [s.verdict for s in scores] == [Verdict.ERROR, Verdict.CORRECT]


def test_verifier_stage_scores_every_rollout_and_dead_letters_the_rest() -> None:
    config = RunConfig.model_validate(
        {"run": "r", "task": {"name": "unruly"}, "verifier": {"workers": 1, "timeout_s": 0.5}}
    )
    names = TopicNames("r")
    t = MemoryTransport()
    t.create_topics(names.all_topics(partitions=2))
    p = t.producer("actor")
    serde = default_serde()
    texts = ["5", "raise", "nan", "hang", "6"]
    rollouts = []
    for k, text in enumerate(texts):
        r = make_rollout(0, k, group_size=len(texts), run_id="r")
        r = replace(r, text=text, problem=replace(r.problem, task="unruly", answer="5"))
        rollouts.append(r)
        p.produce(names[RAW_ROLLOUTS], serde.encode(r), key=r.group_id)
    p.produce(names[RAW_ROLLOUTS], b"not a rollout", key="x")
    other = make_rollout(1, 0, run_id="r")  # task arithmetic: not this run's
    p.produce(names[RAW_ROLLOUTS], serde.encode(other), key=other.group_id)
    stats = verifier.run(config, transport=t, max_records=7, idle_timeout_s=5)
    assert stats.records_in == 7 and stats.records_out == 5 and stats.dlq == 2
    scored = {
        s.rollout.rollout_id: s
        for s in (serde.decode(m.value, ScoredRollout) for m in t.messages(names[SCORED]))
    }
    by_text = {r.text: scored[r.rollout_id] for r in rollouts}
    assert by_text["5"].verdict is Verdict.CORRECT and by_text["5"].reward == 1.0
    assert by_text["raise"].verdict is Verdict.ERROR and by_text["raise"].reward == -1.0
    assert by_text["nan"].verdict is Verdict.ERROR and "nan" in by_text["nan"].detail
    assert by_text["hang"].verdict is Verdict.TIMEOUT and by_text["hang"].reward == -1.0
    assert by_text["6"].verdict is Verdict.WRONG
    assert all(isinstance(s.rollout, Rollout) and s.verifier_id == "verifier-0" for s in scored.values())
    dlq = t.messages(names.dlq(RAW_ROLLOUTS))
    assert sorted(m.key for m in dlq) == sorted([b"x", other.group_id.encode()])
