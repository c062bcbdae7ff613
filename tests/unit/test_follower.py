"""VersionFollower keeps the latest weight version of a run; RecordFollower a bounded window."""

from __future__ import annotations

import time

import pytest
from fakes.records import make_eval_result, make_weight_version

from stream_rl.contracts import EvalResult
from stream_rl.kafka.follower import RecordFollower, VersionFollower
from stream_rl.kafka.memory import MemoryTransport
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.topics import EVAL_RESULTS, WEIGHT_VERSIONS, TopicNames

pytestmark = pytest.mark.unit


def test_follows_versions_and_waits() -> None:
    t = MemoryTransport()
    names = TopicNames(run="r")
    t.create_topics(names.all_topics())
    follower = VersionFollower(t, names, keep_history=True).start()
    try:
        assert follower.latest is None
        assert not follower.wait_for_version(0, timeout=0.05)
        p = t.producer("trainer")
        for v in range(3):
            p.produce(names[WEIGHT_VERSIONS], default_serde().encode(make_weight_version(v)), key="r")
        p.produce(names[WEIGHT_VERSIONS], b"garbage", key="r")
        assert follower.wait_for_version(2, timeout=5)
        latest = follower.latest
        assert latest is not None and latest.version == 2
        assert [w.version for w in follower.drain()] == [0, 1, 2]
        assert follower.drain() == []  # handed over once: the follower keeps nothing
    finally:
        follower.stop()


def test_record_follower_keeps_a_bounded_window_and_hands_each_record_over_once() -> None:
    """A long run's eval-results cost the launcher, the trainer (`eval.pin`) and the trackers the
    same memory as a short one's: `records` is the last `keep`, `drain()` hands each over once."""
    t = MemoryTransport()
    names = TopicNames(run="r")
    t.create_topics(names.all_topics())
    topic = names[EVAL_RESULTS]
    follower = RecordFollower(t, topic, EvalResult, "evals", keep=8, keep_history=True).start()
    try:
        p = t.producer("evaluator")
        drained: list[int] = []
        for v in range(0, 500, 10):
            p.produce(topic, default_serde().encode(make_eval_result(v)), key="r")
        deadline = time.monotonic() + 5
        while len(drained) < 50 and time.monotonic() < deadline:
            drained += [ev.version for ev in follower.drain()]
            time.sleep(0.01)
        assert drained == list(range(0, 500, 10))
        assert [ev.version for ev in follower.records] == list(range(420, 500, 10))
        assert follower.drain() == []
        assert len(follower._pending) == 0 and len(follower._records) == 8  # noqa: SLF001 - the bound
    finally:
        follower.stop()


class _Sink:
    def __init__(self) -> None:
        self.logged: list[tuple[int, bool]] = []

    def params(self, params: dict[str, object]) -> None:
        pass

    def log(self, version: int, metrics: dict[str, float], wall_ms: int) -> None:
        self.logged.append((version, any(k.startswith("eval/") for k in metrics)))

    def close(self) -> None:
        pass


def _follow_a_run(versions: list[int], evals: list[int]) -> tuple[int, _Sink]:
    """`stream-rl track`'s follow loop over a run on the in-memory transport whose weight-versions
    hold `versions` (the last one published as the final version) and eval-results `evals`:
    (what it returns, what its sink logged)."""
    from dataclasses import replace

    from stream_rl.config import RunConfig
    from stream_rl.contracts import WeightVersionKind
    from stream_rl.kafka.stage import StopFlag
    from stream_rl.tools.track import follow

    config = RunConfig.model_validate({"run": "r", "eval": {"every": 2}})
    t = MemoryTransport()
    names = TopicNames(run="r")
    t.create_topics(names.all_topics())
    p = t.producer("trainer")
    final = replace(make_weight_version(versions[-1], run_id="r"), kind=WeightVersionKind.FINAL)
    for wv in [*(make_weight_version(v, run_id="r") for v in versions[:-1]), final]:
        p.produce(names[WEIGHT_VERSIONS], default_serde().encode(wv), key="r")
    for v in evals:
        p.produce(names[EVAL_RESULTS], default_serde().encode(make_eval_result(v)), key="r")
    sink = _Sink()
    return follow(config, t, [sink], StopFlag()), sink


def test_track_follow_logs_each_version_and_evaluation_once_until_the_final_one() -> None:
    """The tracker keeps the newest version logged, not every version: a version published again
    (a restarted trainer's mismatch) is still logged once."""
    logged, sink = _follow_a_run([0, 1, 2, 3, 2, 4], [0, 2, 4])
    assert logged == 5
    assert sorted(v for v, is_eval in sink.logged if not is_eval) == [0, 1, 2, 3, 4]
    assert sorted(v for v, is_eval in sink.logged if is_eval) == [0, 2, 4]


def test_track_follow_logs_the_final_evaluation_read_after_its_last_drain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The final version's evaluation can be decoded by the follower's thread after the loop's
    drain and before its "was the final version evaluated?" check, which then ends the loop: it is
    still logged (seen: a TensorBoard run missing its last eval point). The thread's timing is
    played here: the drain that would hand over version 4's result hands it over one call later."""
    drain = RecordFollower.drain
    held: list[EvalResult] = []

    def racing_drain(self: RecordFollower[EvalResult]) -> list[EvalResult]:
        out = drain(self)
        late = [ev for ev in out if ev.version == 4]
        if late and not held:
            held.extend(late)
            with self._lock:  # noqa: SLF001 - as the thread would: in `records` already, pending
                self._pending[:0] = late  # noqa: SLF001
            return [ev for ev in out if ev.version != 4]
        return out

    monkeypatch.setattr(RecordFollower, "drain", racing_drain)
    logged, sink = _follow_a_run([0, 1, 2, 3, 4], [0, 2, 4])
    assert logged == 5
    assert held, "the race was played"
    assert sorted(v for v, is_eval in sink.logged if is_eval) == [0, 2, 4]
