"""When the launcher looks for hanging transactions (stream_rl/kafka/hanging.py `HangingWatch`): once
no weight version came for CHECK_AFTER_S, then at most every EVERY_S while none comes, never
while versions come; what it found said in one line each. The program itself runs against a real
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
