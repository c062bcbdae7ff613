"""Routing the actor's calls to inference servers: least loaded first, a cap per server, retries
with exponential backoff, dead servers set aside and probed back.

Contract of `ServerPool.call(fn)`:
- `fn(server)` (use `server.client`, `server.url`) runs on the live server with the fewest calls in flight (ties: the one used
  least recently), never more than `cap` calls at once per server; a multi-turn rollout is ONE
  call, so all its turns stay on one server (its weight versions only grow).
- A call that raises `InferenceError` (connection refused, timeout, HTTP error) counts against
  its server. `max_retries` consecutive failures mark the server dead: no calls are routed to
  it; after `cooldown_s` (doubling while it stays down, up to `cooldown_max_s`) its `/health`
  is probed, and a healthy answer puts it back.
- The failed call is retried (backoff `backoff_s` doubling up to `backoff_max_s`), on whatever
  server is then least loaded. While every server is dead the call waits (logged every
  `log_every_s`): a server outage delays problems, it never drops them.
- A request that keeps failing while the servers answer others (some call or probe succeeded
  since its previous failure), or that raises another `StreamRLError` (a task error, an invalid
  completion), earns a strike; more than `max_retries` strikes raise `RequestRejected`, and the
  actor sends the problem to the DLQ: the servers work, this request does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from stream_rl.config import RunConfig
from stream_rl.errors import ConfigError, InferenceError, StreamRLError

log = logging.getLogger(__name__)

T = TypeVar("T")


ClientFactory = Callable[[str], Any]
"""url -> client of that server (`complete_many`, `complete`, `health`, `version`, `aclose`)."""


def server_urls(config: RunConfig) -> list[str]:
    """The inference servers of a run (`inference.server_list()`); at least one."""
    urls = config.inference.server_urls()
    if not urls:
        raise ConfigError("inference: no servers (set inference.servers or inference.num_servers)")
    return urls


def inference_client_factory(config: RunConfig) -> ClientFactory:
    """The HTTP client of each server's engine (`stream_rl.inference.client.make_client`)."""
    from stream_rl.inference.client import make_client

    engines = {s.url: str(s.engine) for s in config.inference.server_list()}

    def make(url: str) -> Any:
        return make_client(
            engines.get(url, config.inference.engine), url, timeout_s=config.actor.request_timeout_s
        )

    return make


class RequestRejected(InferenceError):
    """A request failed `max_retries + 1` times while the servers were otherwise healthy."""


@dataclass(eq=False)
class Server:
    url: str
    client: Any
    in_flight: int = 0
    failures: int = 0
    """Consecutive failed calls."""
    dead: bool = False
    cooldown_s: float = 0.0
    last_used: float = 0.0
    ok: int = 0
    failed: int = 0


class ServerPool:
    """The actor's view of the inference servers. Use from one event loop."""

    def __init__(
        self,
        clients: dict[str, Any],
        *,
        cap: int,
        max_retries: int,
        backoff_s: float = 0.2,
        backoff_max_s: float = 10.0,
        cooldown_s: float = 2.0,
        cooldown_max_s: float = 60.0,
        health_timeout_s: float = 5.0,
        log_every_s: float = 10.0,
    ) -> None:
        if not clients:
            raise InferenceError(
                "no inference servers: set inference.servers (urls) or inference.num_servers"
            )
        self.servers = [Server(url, client) for url, client in clients.items()]
        self.cap = cap
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.cooldown_s = cooldown_s
        self.cooldown_max_s = cooldown_max_s
        self.health_timeout_s = health_timeout_s
        self.log_every_s = log_every_s
        self.successes = 0
        """Successful calls and probes: evidence the servers work."""
        self._changed = asyncio.Condition()
        self._probes: set[asyncio.Task[None]] = set()
        self._last_all_dead_log = 0.0

    # -- state -----------------------------------------------------------------------------------
    def live(self) -> list[Server]:
        return [s for s in self.servers if not s.dead]

    def in_flight(self) -> int:
        return sum(s.in_flight for s in self.servers)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _pick(self) -> Server | None:
        ready = [s for s in self.servers if not s.dead and s.in_flight < self.cap]
        if not ready:
            return None
        return min(ready, key=lambda s: (s.in_flight, s.last_used))

    async def acquire(self) -> Server:
        """A slot on the least-loaded live server; waits while none has one."""
        async with self._changed:
            while True:
                server = self._pick()
                if server is not None:
                    server.in_flight += 1
                    server.last_used = time.monotonic()
                    return server
                if not self.live():
                    now = time.monotonic()
                    if now - self._last_all_dead_log >= self.log_every_s:
                        self._last_all_dead_log = now
                        log.warning(
                            "all %d inference servers are down (%s); waiting for one to answer /health, "
                            "problems are kept",
                            len(self.servers),
                            ", ".join(s.url for s in self.servers),
                        )
                # Woken by a release, a revival or a new death; the timeout re-logs.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout=self.log_every_s)

    async def release(self, server: Server, error: BaseException | None, *, counted: bool = True) -> None:
        """Return a slot; `error` is the InferenceError the call raised, if it did. `counted=False`
        (a cancelled call) leaves the server's record alone."""
        server.in_flight -= 1
        if not counted:
            pass
        elif error is None:
            server.ok += 1
            server.failures = 0
            self.successes += 1
        else:
            server.failed += 1
            server.failures += 1
            if not server.dead and server.failures >= max(self.max_retries, 1):
                self._mark_dead(server, error)
        await self._notify()

    def _mark_dead(self, server: Server, error: BaseException) -> None:
        server.dead = True
        server.cooldown_s = self.cooldown_s
        log.warning(
            "inference server %s taken out of routing after %d consecutive failures (last: %s); "
            "probing /health in %.1fs",
            server.url,
            server.failures,
            error,
            server.cooldown_s,
        )
        task = asyncio.create_task(self._probe_until_healthy(server))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _probe_until_healthy(self, server: Server) -> None:
        while True:
            await asyncio.sleep(server.cooldown_s)
            try:
                await asyncio.wait_for(server.client.health(), timeout=self.health_timeout_s)
            except (InferenceError, TimeoutError) as exc:
                server.cooldown_s = min(server.cooldown_s * 2, self.cooldown_max_s)
                log.info(
                    "inference server %s still down (%s); next probe in %.1fs",
                    server.url,
                    exc,
                    server.cooldown_s,
                )
                continue
            server.dead = False
            server.failures = 0
            self.successes += 1
            log.info("inference server %s is healthy again: back in routing", server.url)
            await self._notify()
            return

    # -- calls -----------------------------------------------------------------------------------
    def backoff(self, attempt: int) -> float:
        """Delay before retry number `attempt` (1-based)."""
        return float(min(self.backoff_s * 2 ** min(attempt - 1, 30), self.backoff_max_s))

    async def call(self, fn: Callable[[Server], Awaitable[T]], what: str) -> T:
        """Run `fn(server)` on a server as described in the module docstring; returns its result."""
        attempt = 0
        strikes = 0
        evidence = self.successes  # successes seen by the previous failure (or the start)
        while True:
            server = await self.acquire()
            try:
                result = await fn(server)
            except InferenceError as exc:
                await self.release(server, exc)
                if self.successes > evidence:
                    strikes += 1
                error: StreamRLError = exc
            except StreamRLError as exc:
                # Not the server's fault (the server answered): a strike, the server stays.
                await self.release(server, None)
                strikes += 1
                error = exc
            except BaseException:
                await self.release(server, None, counted=False)
                raise
            else:
                await self.release(server, None)
                return result
            evidence = self.successes
            if strikes > self.max_retries:
                raise RequestRejected(
                    f"{what}: failed {attempt + 1} times, servers otherwise healthy: {error}"
                )
            attempt += 1
            delay = self.backoff(attempt)
            log.info(
                "%s: attempt %d on %s failed (%s); retrying in %.2fs", what, attempt, server.url, error, delay
            )
            await asyncio.sleep(delay)

    async def aclose(self) -> None:
        for task in list(self._probes):
            task.cancel()
        await asyncio.gather(*self._probes, return_exceptions=True)
        for s in self.servers:
            await s.client.aclose()
