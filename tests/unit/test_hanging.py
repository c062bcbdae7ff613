"""When the launcher looks for hanging transactions (stream_rl/kafka/hanging.py `HangingWatch`): once
no weight version came for CHECK_AFTER_S, or a partition stayed held at one last stable offset that
long, then at most every EVERY_S while either holds, never while versions come and no partition is
held; what it found said in one line each. The program itself runs against a real
broker in tests/integration/test_hanging_transactions.py."""

from __future__ import annotations

from typing import Any

import pytest

from stream_rl.config import KafkaConfig
from stream_rl.kafka import hanging
from stream_rl.kafka.hanging import CHECK_AFTER_S, EVERY_S, Hanging, HangingWatch

pytestmark = pytest.mark.unit

ABORTED = "hanging stream-rl.r.scored 1 producer 4 epoch 2 from offset 85 age 61000: aborted"


def _watch(
    monkeypatch: pytest.MonkeyPatch, found: Hanging
) -> tuple[HangingWatch, list[dict[str, Any]], list[str]]:
    calls: list[dict[str, Any]] = []
    said: list[str] = []

    def fake(kafka: KafkaConfig, bootstrap: str, topics: list[str], **kw: Any) -> Hanging:
        calls.append({"bootstrap": bootstrap, "topics": topics, **kw})
        return found

    monkeypatch.setattr(hanging, "find_hanging", fake)
    return (
        HangingWatch(KafkaConfig(), "b:9092", ["stream-rl.r.scored"], "stream-rl.r.", said.append),
        calls,
        said,
    )


def test_it_looks_once_no_version_came_for_a_while_and_then_every_so_often(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    watch, calls, said = _watch(monkeypatch, Hanging(True, [ABORTED, "open x 0 producer 1 ...: Ongoing"]))
    watch.tick(0.0, 7)
    watch.tick(CHECK_AFTER_S - 1, 7)
    assert calls == []
    watch.tick(CHECK_AFTER_S, 7)
    watch.join()
    assert calls == [
        {
            "bootstrap": "b:9092",
            "topics": ["stream-rl.r.scored"],
            "transactional_prefix": "stream-rl.r.",
            "abort": True,
            "min_age_s": hanging.MIN_AGE_S,
        }
    ]
    assert said == [f"a hanging transaction (KIP-664) held the run: {ABORTED}"]
    assert watch.aborted == [ABORTED]
    watch.tick(CHECK_AFTER_S + EVERY_S - 1, 7)
    watch.join()
    assert len(calls) == 1
    watch.tick(CHECK_AFTER_S + EVERY_S, 7)
    watch.join()
    assert len(calls) == 2


def test_versions_coming_keep_it_from_looking(monkeypatch: pytest.MonkeyPatch) -> None:
    watch, calls, said = _watch(monkeypatch, Hanging(True, []))
    for i in range(10):
        watch.tick(i * (CHECK_AFTER_S / 2), i)  # a new version every half of the wait
    watch.join()
    assert calls == [] and said == []
    watch.tick(10 * CHECK_AFTER_S, 9)
    watch.join()
    assert len(calls) == 1 and said == []  # nothing hanging: nothing said


def test_a_check_that_could_not_run_says_nothing_to_the_user(monkeypatch: pytest.MonkeyPatch) -> None:
    watch, calls, said = _watch(monkeypatch, Hanging(False, why="not tried on a secured cluster"))
    watch.tick(0.0, None)
    watch.tick(CHECK_AFTER_S, None)
    watch.join()
    assert len(calls) == 1 and said == [] and watch.checks == 1


HELD = ("stream-rl.r.scored", 0)


def test_a_partition_held_at_one_offset_while_versions_come_is_looked_at(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hang on one partition of several: versions go on from the others (until the held samples
    fill the actor's admission window), so only the held partition's last stable offset tells."""
    watch, calls, said = _watch(monkeypatch, Hanging(True, [ABORTED]))
    for i in range(4):
        watch.tick(i * (CHECK_AFTER_S / 4), i, {HELD: 85})
    watch.join()
    assert calls == []  # held for 30 s: a live transaction is decided within 15 s, still not looked at
    watch.tick(CHECK_AFTER_S, 4, {HELD: 85})
    watch.join()
    assert len(calls) == 1 and said == [f"a hanging transaction (KIP-664) held the run: {ABORTED}"]
    assert watch.reason == f"a last stable offset held for {CHECK_AFTER_S:.0f}s (stream-rl.r.scored 0 at 85)"


def test_open_transactions_that_are_decided_keep_it_from_looking(monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy partition is often caught with a transaction open, each time at a later offset."""
    watch, calls, _said = _watch(monkeypatch, Hanging(True, []))
    for i in range(12):
        held = {HELD: 10 * i} if i % 3 else {}  # open at a new offset, or decided, at each look
        watch.tick(i * (CHECK_AFTER_S / 4), i, held)
    watch.join()
    assert calls == []
