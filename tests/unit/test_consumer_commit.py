"""KafkaConsumer.commit: a commit refused because the group rebalanced (a replica joined or left)
is dropped with a warning, so the stage goes on (its outputs are durable: at least once); any
other refusal still raises. Seen for real when `docker compose up --scale verifier=2` made the
first verifier exit on ILLEGAL_GENERATION (tests/docker/test_compose.py)."""

from __future__ import annotations

from typing import Any

import confluent_kafka as ck
import pytest

from stream_rl.errors import KafkaError
from stream_rl.kafka.confluent import KafkaConsumer

pytestmark = pytest.mark.unit


class RefusingConsumer:
    def __init__(self, code: int) -> None:
        self.code = code
        self.calls: list[Any] = []

    def commit(self, offsets: Any, asynchronous: bool) -> None:
        self.calls.append(offsets)
        raise ck.KafkaException(ck.KafkaError(self.code))


def consumer_refusing(code: int) -> tuple[KafkaConsumer, RefusingConsumer]:
    consumer = object.__new__(KafkaConsumer)  # no librdkafka client: the refusal is all we need
    fake = RefusingConsumer(code)
    consumer._c = fake  # type: ignore[assignment]
    consumer.outage_s = 0.3  # transient refusals are retried this long (kafka.outage_timeout_s)
    return consumer, fake


@pytest.mark.parametrize(
    "code",
    [ck.KafkaError.ILLEGAL_GENERATION, ck.KafkaError.UNKNOWN_MEMBER_ID, ck.KafkaError.REBALANCE_IN_PROGRESS],
)
def test_a_commit_refused_by_a_rebalance_is_dropped(code: int, caplog: pytest.LogCaptureFixture) -> None:
    consumer, fake = consumer_refusing(code)
    consumer.commit({("t", 0): 5})
    assert len(fake.calls) == 1
    assert "group rebalanced" in caplog.text


@pytest.mark.parametrize(
    "code", [ck.KafkaError.TOPIC_AUTHORIZATION_FAILED, ck.KafkaError.OFFSET_OUT_OF_RANGE]
)
def test_other_commit_failures_raise(code: int) -> None:
    consumer, _ = consumer_refusing(code)
    with pytest.raises(KafkaError, match="commit"):
        consumer.commit({("t", 0): 5})
