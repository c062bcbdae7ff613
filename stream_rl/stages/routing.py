"""Routing the actor's calls to inference servers: least loaded first, a cap per server, retries
with exponential backoff, dead servers set aside and probed back.

Contract of `ServerPool.call(fn)`:
- `fn(server)` (use `server.client`, `server.url`) runs on the live server with the fewest calls in flight (ties: the one used
  least recently), never more than `cap` calls at once per server; a multi-turn rollout is ONE
  call, so all its turns stay on one server (its weight versions only grow).
- A call that raises `InferenceError` (connection refused, timeout, HTTP error) counts against
  its server. `max_retries` consecutive failures mark the server dead: no calls are routed to
  it; after `cooldown_s` (doubling while it stays down, up to `cooldown_max_s`: 8 s, as a probe
  is one GET; at 60 s a restarted server waited up to ~30 s more to be found) its `/health` is
  probed, and a healthy answer puts it back.
- The failed call is retried (backoff `backoff_s` doubling up to `backoff_max_s`), on whatever
  server is then least loaded. While every server is dead the call waits (logged every
  `log_every_s`): a server outage delays problems, it never drops them.
- A request that keeps failing while the servers answer others (some call or probe succeeded
  since its previous failure), or that raises another `StreamRLError` (a task error, an invalid
  completion), earns a strike; more than `max_retries` strikes raise `RequestRejected`, and the
  actor sends the problem to the DLQ: the servers work, this request does not.
- A server that answers "busy, retry" (`ServerBusy`: vLLM 0.33's 503 while it is paused for a
  weight update in `wait` mode) is back-pressure: the call is retried after the backoff, with no
  failure counted against the server and no strike against the request.
- A request the server refuses as invalid (`BadRequestError`: HTTP 400/413/422, e.g. a prompt
  longer than the model's context) raises `RequestRejected` at once with the server's message:
  the request's fault, so the server's record is untouched and it stays in routing.

Weight versions (`observe(version, servers_updated)`, fed from `weight-versions`): a server is
routed to only while it holds the newest published version. A server the newest version does not
list as updated, or one back from the dead (a restart serves the weights it loaded, version 0's),
is *stale*: set aside, its `version()` probed until it holds the newest version (or a newer
version lists it). `check_fresh(server, spans)` catches the rest: a response with a token sampled
by a version older than `newest - (max_lag + 1)` marks its server stale and raises
`StaleServerError`, and the call is retried on another server (no strike: the request is fine,
and nothing of that response is kept). Staleness is bounded by admission; this only keeps a
server with the wrong weights from feeding the optimizer samples far beyond that bound.

Servers joining and leaving the run (`stream_rl.kafka.servers_topic`): `add(url, client)` puts a
joined server in the pool *stale*, so it is routed to only once it reports holding the newest
published version (the trainer pushes it that version when it reads the same record);
`drain(url)` routes it no new call, lets the calls in flight on it finish, then forgets it (its
client closed). A call that fails on a server that went away meanwhile is retried elsewhere, as
for any failure: nothing is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from stream_rl.config import RunConfig
from stream_rl.contracts import ServerMembership
from stream_rl.errors import BadRequestError, ConfigError, InferenceError, ServerBusy, StreamRLError

if TYPE_CHECKING:
    from stream_rl.inference.builtin_client import CompletionClient

log = logging.getLogger(__name__)

T = TypeVar("T")


ClientFactory = Callable[[str], "CompletionClient"]
"""url -> client of that server (`stream_rl.inference.builtin_client.CompletionClient`)."""


def server_urls(config: RunConfig) -> list[str]:
    """The inference servers of a run (`inference.server_list()`); at least one."""
    urls = config.inference.server_urls()
    if not urls:
        raise ConfigError("inference: no servers (set inference.servers or inference.num_servers)")
    return urls


def inference_client_factory(config: RunConfig, engines: dict[str, str] | None = None) -> ClientFactory:
    """The HTTP client of each server's engine (`stream_rl.inference.clients.make_client`):
    `engines` (url -> engine; the configured servers are added to it, and the caller adds those
    that join the run), else `inference.engine`. Each carries `inference.api_key_secret()`."""
    from stream_rl.inference.clients import make_client

    engines = engines if engines is not None else {}
    engines.update({s.url: str(s.engine) for s in config.inference.server_list()})
    secret = config.inference.api_key_secret()  # read once: a bad reference fails at start
    api_key = secret.get_secret_value() if secret else None

    def make(url: str) -> CompletionClient:
        return make_client(
            engines.get(url, config.inference.engine),
            url,
            timeout_s=config.actor.request_timeout_s,
            api_key=api_key,
        )

    return make


class RequestRejected(InferenceError):
    """A request failed `max_retries + 1` times while the servers were otherwise healthy, or a
    server refused it as invalid."""


class StaleServerError(InferenceError):
    """A server answered with tokens of weights older than the run's staleness floor."""


@dataclass(eq=False)
class Server:
    url: str
    client: CompletionClient
    in_flight: int = 0
    failures: int = 0
    """Consecutive failed calls."""
    dead: bool = False
    cooldown_s: float = 0.0
    last_used: float = 0.0
    ok: int = 0
    failed: int = 0
    version: int | None = None
    """The newest weight version the server is known to hold."""
    stale: bool = False
    """Set aside until it holds the newest published version (module docstring)."""
    draining: bool = False
    """Leaving the run: no new call; forgotten once `in_flight` is 0."""
    gone: bool = False
    """Forgotten (drained): its probes end."""
    probing_version: bool = False
    """A `_probe_until_current` runs for it (it ends when the server goes down, so one back up
    and still stale needs a new one)."""


def _state(server: Server) -> str:
    if server.draining:
        return "draining"
    return "down" if server.dead else "stale" if server.stale else "busy"


class ServerPool:
    """The actor's view of the inference servers. Use from one event loop."""

    def __init__(
        self,
        clients: dict[str, CompletionClient],
        *,
        cap: int,
        max_retries: int,
        backoff_s: float = 0.2,
        backoff_max_s: float = 10.0,
        cooldown_s: float = 2.0,
        cooldown_max_s: float = 8.0,
        health_timeout_s: float = 5.0,
        log_every_s: float = 10.0,
        max_lag: int | None = None,
        version_probe_s: float = 1.0,
    ) -> None:
        """`max_lag`: the run's staleness bound, for `check_fresh` (None: no floor)."""
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
        self.max_lag = max_lag
        self.version_probe_s = version_probe_s
        self.latest: int | None = None
        """The newest published weight version (`observe`)."""
        self.stale_responses = 0
        """Responses thrown away by `check_fresh`."""
        self.busy_answers = 0
        """"Busy, retry" answers (`ServerBusy`), each retried."""
        self.successes = 0
        """Successful calls and probes: evidence the servers work."""
        self._changed = asyncio.Condition()
        self._probes: set[asyncio.Task[None]] = set()
        self._last_all_dead_log = 0.0

    # -- state -----------------------------------------------------------------------------------
    def live(self) -> list[Server]:
        """Servers in routing: neither dead, stale nor draining."""
        return [s for s in self.servers if not s.dead and not s.stale and not s.draining]

    def in_flight(self) -> int:
        return sum(s.in_flight for s in self.servers)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _pick(self) -> Server | None:
        ready = [s for s in self.live() if s.in_flight < self.cap]
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
                            "no inference server in routing (%s); waiting for one to answer /health "
                            "and hold version %s, problems are kept",
                            ", ".join(f"{s.url}: {_state(s)}" for s in self.servers),
                            self.latest,
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
            if not server.dead and not server.draining and server.failures >= max(self.max_retries, 1):
                self._mark_dead(server, error)
        self._forget_if_drained(server)
        await self._notify()

    # -- servers joining and leaving -----------------------------------------------------------
    def find(self, url: str) -> Server | None:
        return next((s for s in self.servers if s.url == url), None)

    def add(self, url: str, client: CompletionClient) -> bool:
        """A server that joined the run (module docstring): routed to once it holds the newest
        version. False (and `client` unused) if the pool has it already; a draining one is taken
        back (and checked for the newest version first)."""
        if self.find(url) is not None:
            self.take_back(url)
            return False
        server = Server(url, client)
        self.servers.append(server)
        self._mark_stale(server, "it joined the run", logging.INFO)
        return True

    def take_back(self, url: str) -> None:
        """A draining server that joined the run again: routed to once it holds the newest version
        (checked first). Nothing if the pool does not have it or it is not draining."""
        known = self.find(url)
        if known is None or not known.draining:
            return
        known.draining = False
        self._mark_stale(known, "it joined the run again")

    def drain(self, url: str) -> bool:
        """Route no new call to `url`; it is forgotten once its calls in flight ended. False if
        the pool does not have it (or drains it already)."""
        server = self.find(url)
        if server is None or server.draining:
            return False
        server.draining = True
        log.info(
            "inference server %s is leaving the run: no new request; %d call(s) in flight finish first",
            url,
            server.in_flight,
        )
        self._forget_if_drained(server)
        return True

    def apply_members(self, records: Iterable[ServerMembership], make_client: ClientFactory) -> list[str]:
        """The `servers` records read since the last call (the latest per url counts): joined ones
        are added (`make_client(url)` for a new one; a draining one is taken back), the others
        drained. Returns the urls that began draining."""
        from stream_rl.kafka.servers_topic import latest_per_url

        drained = []
        for m in latest_per_url(records).values():
            if not m.routable:
                if self.drain(m.url):
                    drained.append(m.url)
            elif self.find(m.url) is not None:
                self.take_back(m.url)  # back from draining, if it was
            else:
                self.add(m.url, make_client(m.url))
                log.info(
                    "inference server %s joined the run: routed to once it holds the newest version", m.url
                )
        return drained

    def _forget_if_drained(self, server: Server) -> None:
        if not server.draining or server.in_flight > 0 or server.gone:
            return
        server.gone = True
        self.servers.remove(server)
        log.info("inference server %s drained: out of the pool (%d calls served)", server.url, server.ok)
        task = asyncio.create_task(server.client.aclose())
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

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
        while not server.gone:
            await asyncio.sleep(server.cooldown_s)
            if server.gone:
                return
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
            if self.latest is not None:
                # A server that went down may have restarted with the weights it loads at start.
                self._mark_stale(server, "back up; its weight version is checked first")
            else:
                log.info("inference server %s is healthy again: back in routing", server.url)
            await self._notify()
            return

    # -- weight versions ---------------------------------------------------------------------------
    def observe(
        self, version: int, servers_updated: Sequence[str], servers_failed: Sequence[str] = ()
    ) -> None:
        """A newly published weight version and the servers the trainer installed it on (a
        trainer that pushes to no server, e.g. in replays, lists none: then nothing is gated)."""
        if self.latest is not None and version <= self.latest:
            return
        self.latest = version
        updated = set(servers_updated)
        if not updated and not servers_failed:
            return
        for server in self.servers:
            if server.draining:
                continue
            if server.url in updated:
                server.version = max(server.version or 0, version)
                if server.stale and not server.dead:
                    server.stale = False
                    log.info("inference server %s holds version %d: back in routing", server.url, version)
            elif not server.dead and not server.stale and (server.version or -1) < version:
                self._mark_stale(server, f"version {version} was not installed on it")

    def check_fresh(self, server: Server, oldest_version: int) -> None:
        """Raise `StaleServerError` (and set the server aside) if a response's oldest token
        version is below the run's floor, `newest published - (max_lag + 1)`."""
        if self.max_lag is None or self.latest is None:
            return
        floor = self.latest - (self.max_lag + 1)
        if oldest_version >= floor:
            server.version = max(server.version or 0, oldest_version)
            return
        self.stale_responses += 1
        self._mark_stale(
            server, f"it answered with tokens of version {oldest_version}, below the floor {floor}"
        )
        raise StaleServerError(
            f"{server.url} sampled with version {oldest_version}, older than newest {self.latest} - "
            f"(max_lag {self.max_lag} + 1): the answer is dropped and the request retried elsewhere"
        )

    def _mark_stale(self, server: Server, why: str, level: int = logging.WARNING) -> None:
        if server.stale and server.probing_version:
            return
        if not server.stale:
            server.stale = True
            log.log(
                level,
                "inference server %s set aside: %s; waiting until it holds version %s",
                server.url,
                why,
                self.latest,
            )
        else:  # stale, but its probe ended when it went down: it is back, probe again
            log.info(
                "inference server %s %s; waiting until it holds version %s", server.url, why, self.latest
            )
        server.probing_version = True
        task = asyncio.create_task(self._probe_until_current(server))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _probe_until_current(self, server: Server) -> None:
        try:
            while server.stale and not server.dead and not server.gone:
                await asyncio.sleep(self.version_probe_s)
                try:
                    held = await asyncio.wait_for(server.client.version(), timeout=self.health_timeout_s)
                except (InferenceError, TimeoutError):
                    continue
                if held is not None and self.latest is not None and held >= self.latest and server.stale:
                    server.stale = False
                    server.version = held
                    log.info("inference server %s holds version %d: back in routing", server.url, held)
                    await self._notify()
        finally:
            server.probing_version = False

    # -- calls -----------------------------------------------------------------------------------
    def backoff(self, attempt: int) -> float:
        """Delay before retry number `attempt` (1-based)."""
        return float(min(self.backoff_s * 2 ** min(attempt - 1, 30), self.backoff_max_s))

    async def call(self, fn: Callable[[Server], Awaitable[T]], what: str) -> T:
        """Run `fn(server)` on a server as described in the module docstring; returns its result."""
        attempt = 0
        busy = 0
        strikes = 0
        evidence = self.successes  # successes seen by the previous failure (or the start)
        while True:
            server = await self.acquire()
            try:
                result = await fn(server)
            except BadRequestError as exc:
                await self.release(server, None)  # it answered: the request is at fault
                raise RequestRejected(f"{what}: refused by {server.url}: {exc}") from exc
            except StaleServerError as exc:
                await self.release(server, None, counted=False)
                log.info("%s: %s", what, exc)
                continue
            except ServerBusy as exc:
                await self.release(server, None, counted=False)
                self.busy_answers += 1
                busy += 1
                delay = self.backoff(busy)
                log.info("%s: %s is busy (%s); retrying in %.2fs", what, server.url, exc, delay)
                await asyncio.sleep(delay)
                continue
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
