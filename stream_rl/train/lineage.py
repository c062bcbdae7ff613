"""Read a run's `weight-versions` log to its current end (no group, nothing committed).

The trainer reads it on start to tell re-trained versions (after a restart from a checkpoint)
from new ones, and `replay trainer` reads it for the step boundaries and checksums.
"""

from __future__ import annotations

import logging
import time

from stream_rl.contracts import WeightVersion
from stream_rl.errors import ContractError, KafkaError
from stream_rl.kafka.serde import Serde, default_serde
from stream_rl.kafka.topics import WEIGHT_VERSIONS, TopicNames
from stream_rl.kafka.transport import Transport

log = logging.getLogger(__name__)


def read_weight_versions(
    transport: Transport, names: TopicNames, serde: Serde | None = None, timeout_s: float = 30.0
) -> list[WeightVersion]:
    """Every `WeightVersion` of the run, in log order (undecodable records are skipped, logged)."""
    serde = serde or default_serde()
    topic = names.topic(WEIGHT_VERSIONS)
    ends = {p: hi for p, (_lo, hi) in transport.watermarks(topic).items()}
    out: list[WeightVersion] = []
    if not any(ends.values()):
        return out
    consumer = transport.consumer(None, "trainer-lineage")
    try:
        consumer.assign({(topic, p): 0 for p in ends})
        deadline = time.monotonic() + timeout_s
        seen = dict.fromkeys(ends, 0)
        while any(seen[p] < ends[p] for p in ends):
            if time.monotonic() > deadline:
                raise KafkaError(f"reading {topic}: only {seen} of {ends} records within {timeout_s}s")
            for msg in consumer.poll_batch(500, 0.5):
                seen[msg.partition] = msg.offset + 1
                try:
                    out.append(serde.decode(msg.value, WeightVersion))
                except ContractError as exc:
                    log.error("%s@%d: undecodable WeightVersion skipped: %s", topic, msg.offset, exc)
    finally:
        consumer.close()
    return out


def by_version(history: list[WeightVersion]) -> dict[int, WeightVersion]:
    """The first record of each version (later duplicates are re-publications after a mismatch)."""
    out: dict[int, WeightVersion] = {}
    for wv in history:
        out.setdefault(wv.version, wv)
    return out
