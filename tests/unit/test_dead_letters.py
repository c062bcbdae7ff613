"""The one dead-letter writer: original bytes and key, the headers, the metric, no DLQ refused."""

from __future__ import annotations

import pytest

from stream_rl.common.metrics import DLQ
from stream_rl.errors import ContractError
from stream_rl.kafka.dead_letters import MAX_ERROR_CHARS, DeadLetters
from stream_rl.kafka.memory import MemoryTransport
from stream_rl.kafka.transport import Message

pytestmark = pytest.mark.unit


def test_a_dead_letter_keeps_the_record_and_says_why_and_where_from() -> None:
    t = MemoryTransport()
    t.create_topics([("x.dlq", 1, {})])
    before = DLQ.labels("teststage", "x")._value.get()
    msg = Message("x", 3, 41, b"key", b"\x00raw")
    DeadLetters("teststage", "x.dlq").write(t.producer("p"), msg, "e" * (MAX_ERROR_CHARS + 5))
    [dl] = t.messages("x.dlq")
    assert (dl.key, dl.value) == (b"key", b"\x00raw")
    headers = dict(dl.headers)
    assert headers["error"] == b"e" * MAX_ERROR_CHARS
    assert headers["error.stage"] == b"teststage"
    assert (headers["original.topic"], headers["original.partition"], headers["original.offset"]) == (
        b"x",
        b"3",
        b"41",
    )
    assert int(headers["error.time_ms"]) > 0
    assert DLQ.labels("teststage", "x")._value.get() == before + 1


def test_a_stage_without_a_dlq_refuses_a_bad_record() -> None:
    with pytest.raises(ContractError, match="no DLQ configured: bad"):
        DeadLetters("teststage", None).letter(Message("x", 0, 0, None, b""), "bad")
