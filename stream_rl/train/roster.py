"""The trainer's servers: the configured ones plus those that joined the run, less those that left.

Fed from the `servers` topic (`stream_rl.kafka.servers_topic`): `apply(records)` adds a joined server
to the weight sender (`add_server`: the next `connect()` joins it) and forgets a draining or left
one (its group released, never re-joined); it returns the urls that joined, which the trainer then
connects and pushes the current version at once (`TrainerStage._welcome`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from stream_rl.config import RunConfig, ServerConfig
from stream_rl.contracts import ServerMembership
from stream_rl.kafka.servers_topic import latest_per_url
from stream_rl.train.push import WeightPusher, add_server

log = logging.getLogger(__name__)


class Roster:
    def __init__(self, config: RunConfig, pusher: WeightPusher | None) -> None:
        self.config = config
        self.pusher = pusher
        self.servers: dict[str, ServerConfig] = {s.url: s for s in config.inference.server_list()}
        self.from_topic: set[str] = set()
        """The servers in `servers` that came from a `joined` record."""

    def urls(self) -> list[str]:
        return list(self.servers)

    def configs(self) -> list[ServerConfig]:
        return list(self.servers.values())

    def apply(self, records: Iterable[ServerMembership]) -> list[str]:
        """Take the membership records in (the latest per url counts); returns the urls added."""
        added = []
        for m in latest_per_url(records).values():
            known = m.url in self.servers
            if m.routable and not known:
                server = ServerConfig.model_validate({"url": m.url, "engine": m.engine})
                self.servers[server.url] = server
                self.pusher = add_server(self.config, self.pusher, server)
                self.from_topic.add(server.url)
                added.append(server.url)
                log.info("server %s (%s) joined the run: joining it to the weight sync", m.url, m.engine)
            elif not m.routable and known:
                del self.servers[m.url]
                self.from_topic.discard(m.url)
                if self.pusher is not None:
                    self.pusher.forget(m.url)
                log.info("server %s is %s: no more weights are pushed to it", m.url, m.state.value)
        return added
