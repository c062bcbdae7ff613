"""The run's inference servers beyond its config: the `servers` topic (compacted, key = url).

A server that joins a run while it goes on is announced there (`stream-rl servers join`, after the
server answers its health route); one that leaves is announced `draining`, then `left`
(`stream-rl servers leave`). The latest record per url is that server's membership; the protocol
is in `docs/servers-protocol.md`. Readers:
- the trainer (`stream_rl.stages.trainer`): a joined server is added to the weight sync, joined
  and pushed the current version at once; a draining or left one is dropped and never re-joined;
- the actors (`stream_rl.stages.routing.ServerPool`): a joined server is routed to only once it
  holds the newest version; a draining one gets no new request and is forgotten when its calls in
  flight have ended;
- `stream-rl status` lists them with the configured servers.

A configured server (`inference.servers` or the launched ones) may be drained too; a url announced
`joined` that the config already names changes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from stream_rl.contracts import ServerMembership
from stream_rl.errors import ContractError
from stream_rl.kafka.follower import RecordFollower
from stream_rl.kafka.reader import read_to_end
from stream_rl.kafka.serde import Serde, default_serde
from stream_rl.kafka.topics import SERVERS, TopicNames
from stream_rl.kafka.transport import Transport

log = logging.getLogger(__name__)


def announce(
    transport: Transport, names: TopicNames, membership: ServerMembership, serde: Serde | None = None
) -> None:
    """Write `membership` (keyed by its url) and wait until the broker has it."""
    serde = serde or default_serde()
    producer = transport.producer("servers")
    try:
        producer.produce(names[SERVERS], serde.encode(membership), key=membership.url)
        producer.flush()
    finally:
        producer.close()


def latest_per_url(records: Iterable[ServerMembership]) -> dict[str, ServerMembership]:
    """The last record of each url, in the order the urls first appear."""
    out: dict[str, ServerMembership] = {}
    for record in records:
        out[record.url] = record
    return out


def read_members(
    transport: Transport, names: TopicNames, serde: Serde | None = None, timeout_s: float = 30.0
) -> dict[str, ServerMembership]:
    """Every server's latest membership record (empty for a run whose topics predate the topic)."""
    serde = serde or default_serde()
    topic = names[SERVERS]
    if topic not in set(transport.list_topic_names()):
        log.warning("no topic %s (run `stream-rl topics apply`): no server can join this run", topic)
        return {}
    records = []
    for msg in read_to_end(transport, topic, client_id="servers-reader", timeout_s=timeout_s):
        try:
            records.append(serde.decode(msg.value, ServerMembership))
        except ContractError as exc:
            log.error("%s@%d: undecodable ServerMembership skipped: %s", msg.topic, msg.offset, exc)
    return latest_per_url(records)


def follow_members(
    transport: Transport, names: TopicNames, client_id: str
) -> RecordFollower[ServerMembership]:
    """A started follower of the `servers` topic from its start; `drain()` gives the records since
    the last call (`latest_per_url` reduces them to what changed)."""
    return RecordFollower(
        transport, names[SERVERS], ServerMembership, client_id, keep=1, keep_history=True
    ).start()
