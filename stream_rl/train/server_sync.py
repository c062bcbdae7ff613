"""The trainer's side of its servers over a run: pushes, re-joins, and servers joining and leaving.

`ServerSync` owns the weight sender (through `Roster`: the configured servers plus those that joined
the run on the `servers` topic), and is what `stream_rl.stages.trainer` calls:
- `start()`: the servers that joined before this start are added, the topic followed, every server
  asked to join (the configured ones waited for, `connect_servers`);
- `push(version, named)` after each step (and `rejoin_due()` before it: dropped servers that answer
  `/health` re-join at most every `RECONNECT_EVERY_S`, so a restarted server gets the next version);
- `while_idle(weights, version)` while no input comes: live servers holding an older version than
  pushed are dropped (restarted since: `drop_restarted`), the dropped ones that answer re-join and
  are pushed the current version at once (else a run whose every server restarted would wait for
  good: the actors route to no server older than the bound, so no step would come);
- `check_members(weights, version)` between micro-batches: a server that joined is joined to the
  weight sync and pushed the current version now, before any actor routes to it; a leaving one is
  forgotten (`Roster.apply`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from stream_rl.config import RunConfig, ServerConfig
from stream_rl.contracts import ServerMembership
from stream_rl.errors import WeightSyncError
from stream_rl.kafka.follower import RecordFollower
from stream_rl.kafka.serde import Serde
from stream_rl.kafka.servers_topic import follow_members, read_members
from stream_rl.kafka.stage import StopFlag
from stream_rl.kafka.topics import TopicNames
from stream_rl.kafka.transport import Transport
from stream_rl.train import metrics as tm
from stream_rl.train.push import (
    PushOutcome,
    WeightPusher,
    connect_servers,
    drop_restarted,
    held_versions,
    rejoin_dropped,
)
from stream_rl.train.roster import Roster

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

RECONNECT_EVERY_S = 2.0
"""Dropped servers that answer /health are asked to re-join at most this often (before a push, so
a restarted server gets the next version at once and is routed to again); while no step completes,
live servers are asked for the version they hold at most this often too (`while_idle`)."""
MEMBERS_EVERY_S = 0.5
"""How often the records of servers joining and leaving are applied."""

Weights = Callable[[], AbstractContextManager[Sequence[tuple[str, "torch.Tensor"]]]]
"""The trainer backend's `full_weights` (a context manager of the named tensors)."""


class ServerSync:
    def __init__(self, config: RunConfig, pusher: WeightPusher | None, bucket_bytes: int) -> None:
        self.config = config
        self.roster = Roster(config, pusher)
        self.bucket_bytes = bucket_bytes
        self.pushed: int | None = None
        """The version of the last push: every server still live holds it (a failing one is dropped)."""
        self.restarted = 0
        """Live servers found restarted (dropped, re-joined, re-pushed) by this process."""
        self.restarted_since_step = 0
        self._last_connect = 0.0
        self._last_members = 0.0
        self._members: RecordFollower[ServerMembership] | None = None
        secret = config.inference.api_key_secret()
        self._api_key = secret.get_secret_value() if secret else None

    def _probe(self, servers: Sequence[ServerConfig]) -> dict[str, int | None]:
        """`held_versions` with the servers' OpenAI-routes key (the built-in `/v1/models` needs it)."""
        return held_versions(servers, api_key=self._api_key)

    @property
    def pusher(self) -> WeightPusher | None:
        return self.roster.pusher

    def start(self, transport: Transport, names: TopicNames, serde: Serde, stop: StopFlag) -> None:
        self.roster.apply(read_members(transport, names, serde).values())
        self._members = follow_members(transport, names, "trainer-servers")
        if self.pusher is not None:
            connect_servers(
                self.pusher, self.config.trainer.connect_timeout_s, stop, optional=self.roster.from_topic
            )
            self._last_connect = time.monotonic()

    def push(self, version: int, named: Sequence[tuple[str, torch.Tensor]]) -> PushOutcome | None:
        """Push `version`; a server it failed on is logged and counted (the sender dropped it)."""
        pusher = self.pusher
        if pusher is None:
            return None
        report = pusher.push(version, named, self.bucket_bytes)
        self.pushed = version
        for url, why in report.failed.items():
            log.warning("server %s dropped at version %d: %s", url, version, why)
            tm.SERVER_FAILURES.inc()
        return report

    def rejoin_due(self) -> None:
        """Before a push: dropped servers that answer `/health` re-join (at most every
        `RECONNECT_EVERY_S`), so that the push reaches them."""
        if self.pusher is not None and time.monotonic() - self._last_connect >= RECONNECT_EVERY_S:
            self._last_connect = time.monotonic()
            rejoin_dropped(self.pusher, self.roster.urls())

    def while_idle(self, weights: Weights, version: int) -> None:
        """Re-join servers that came back while no step completes and push them `version` now
        (module docstring). A server killed and restarted right after a push is still live here (no
        push failed on it): so live servers are first asked which version they hold (one short GET
        each through the engine's route), and one older than the last push is dropped, then
        re-joined and pushed with the others that came back."""
        pusher = self.pusher
        if pusher is None or time.monotonic() - self._last_connect < RECONNECT_EVERY_S:
            return
        self._last_connect = time.monotonic()
        if self.pushed is not None:
            restarted = drop_restarted(pusher, self.roster.configs(), self.pushed, self._probe)
            self.restarted += len(restarted)
            self.restarted_since_step += len(restarted)
            tm.SERVERS_RESTARTED.inc(len(restarted))
        if not rejoin_dropped(pusher, self.roster.urls()):
            return
        with weights() as named:
            report = self.push(version, named)
        if report is not None and report.per_server:
            log.info(
                "version %d pushed to re-joined server(s) %s", version, ", ".join(sorted(report.per_server))
            )

    def check_members(self, weights: Weights, version: int) -> None:
        """Apply the `servers` records read since the last call (at most every `MEMBERS_EVERY_S`);
        a server that joined is joined to the weight sync and pushed `version` now."""
        if self._members is None or time.monotonic() - self._last_members < MEMBERS_EVERY_S:
            return
        self._last_members = time.monotonic()
        joined = self.roster.apply(self._members.drain())
        if joined:
            self._welcome(joined, weights, version)

    def _welcome(self, urls: Sequence[str], weights: Weights, version: int) -> None:
        pusher = self.pusher
        assert pusher is not None  # the roster made one for the joined servers
        started = time.monotonic()
        try:
            failures = dict(pusher.connect())
        except WeightSyncError as exc:
            failures = {url: str(exc) for url in urls}
        for url in urls:
            if url in failures:
                log.warning(
                    "server %s joined the run but not the weight sync: %s (retried while it answers "
                    "/health; it is routed to only once it holds the newest version)",
                    url,
                    failures[url],
                )
        if not any(url in set(pusher.live_servers) for url in urls):
            return
        with weights() as named:
            report = self.push(version, named)
        welcomed = sorted(url for url in urls if report is not None and url in set(report.updated))
        if welcomed:
            tm.SERVERS_JOINED.inc(len(welcomed))
            log.info(
                "version %d pushed to joining server(s) %s, %.0f ms after their record was read",
                version,
                ", ".join(welcomed),
                (time.monotonic() - started) * 1000,
            )

    def close(self) -> None:
        """Stop following the topic and close the sender (every group left)."""
        if self._members is not None:
            self._members.stop()
        if self.pusher is not None:
            self.pusher.close()
