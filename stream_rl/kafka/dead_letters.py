"""Dead letters: the one way a stage sends a record it cannot use to its DLQ topic.

A dead letter is the original record, bytes and key unchanged, on `<topic>.dlq` with headers that
say why and where it came from:

    error               the reason (at most 2000 characters)
    error.stage         the stage that gave up on it
    error.time_ms       when (epoch ms)
    original.topic      where it was consumed
    original.partition
    original.offset

Every dead letter is logged and counted in `stream_rl_dlq_records_total{stage, topic}` (topic:
the original one). `DeadLetters.write` produces it at once; `DeadLetters.letter` returns it for a
stage that produces it inside its own transaction (the preprocessor).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from stream_rl.common.metrics import DLQ
from stream_rl.contracts import now_ms
from stream_rl.errors import ContractError
from stream_rl.kafka.transport import Message, Producer

log = logging.getLogger(__name__)

MAX_ERROR_CHARS = 2000


def dlq_headers(msg: Message, stage: str, error: str) -> dict[str, str | bytes]:
    """The headers of `msg`'s dead letter (see the module docstring)."""
    return {
        "error": error[:MAX_ERROR_CHARS],
        "error.stage": stage,
        "error.time_ms": str(now_ms()),
        "original.topic": msg.topic,
        "original.partition": str(msg.partition),
        "original.offset": str(msg.offset),
    }


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One record for the DLQ topic."""

    topic: str
    value: bytes | None
    key: bytes | None
    headers: dict[str, str | bytes]


class DeadLetters:
    """The DLQ of one stage's input. `topic` None: the stage has no DLQ, and a bad record is a
    `ContractError` (it is not dropped silently)."""

    def __init__(self, stage: str, topic: str | None) -> None:
        self.stage = stage
        self.topic = topic

    def letter(self, msg: Message, error: str) -> DeadLetter:
        """`msg`'s dead letter, logged and counted; the caller produces it."""
        if self.topic is None:
            raise ContractError(f"{self.stage}: bad record and no DLQ configured: {error}")
        log.warning(
            "%s: record %s[%d]@%d to the DLQ: %s", self.stage, msg.topic, msg.partition, msg.offset, error
        )
        DLQ.labels(self.stage, msg.topic).inc()
        return DeadLetter(self.topic, msg.value, msg.key, dlq_headers(msg, self.stage, error))

    def write(self, producer: Producer, msg: Message, error: str) -> None:
        """Produce `msg`'s dead letter with `producer` (durable after its next flush or commit)."""
        dl = self.letter(msg, error)
        producer.produce(dl.topic, dl.value, key=dl.key, headers=dl.headers)
