"""The trainer's view of weight sync: which servers, how to join them, what a push reports.

The senders are `stream_rl.weights.WeightSender` (built-in servers) and the engine adapters
(`stream_rl.weights.adapters`: vLLM, SGLang), chosen per server by its engine; the stage only
needs the `WeightPusher` shape below, so unit tests pass a hand-written fake. Servers are
`inference.server_list()`: `inference.servers` when set, else the launched ones. Zero servers is
allowed: the trainer then only publishes versions (replays, tests, offline training).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from stream_rl.config import RunConfig, ServerConfig
from stream_rl.errors import InferenceError, WeightSyncError
from stream_rl.kafka.stage import StopFlag

if TYPE_CHECKING:
    from stream_rl.weights.server_client import ServerEndpoint

log = logging.getLogger(__name__)


class PushOutcome(Protocol):
    version: int
    broadcast_ms: float
    updated: list[str]
    failed: dict[str, str]
    per_server: dict[str, dict[str, float]]


class WeightPusher(Protocol):
    """What the trainer calls on its weight sender (`ServerSync`, `Roster`, the functions below).
    Implemented by `stream_rl.weights.WeightSender`, `IpcWeightSender` and `AutoSender` (checked
    through `make_builtin_sender`'s return in `_engine_sender`), the engine adapters
    `VLLMWeightSender` and `SGLangWeightSender` (checked by `_engine_sender`'s returns) and
    `MultiSender` (checked by `make_sender`'s return)."""

    @property
    def live_servers(self) -> list[str]: ...

    def connect(self) -> dict[str, str]:
        """Join every server not yet joined; returns failures (url -> reason)."""
        ...

    def push(
        self, version: int, named_tensors: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int
    ) -> PushOutcome: ...

    def drop(self, url: str) -> bool:
        """Take `url` out of its group now (between pushes: nothing is pending on it) and forget
        the version it was pushed; True if it was live. Its release never blocks the caller (the
        peer may be gone). A later `connect()` joins it afresh; the next push sends it the version."""
        ...

    def add(self, server: ServerEndpoint) -> None:
        """One more server (a `ServerEndpoint` that joined the run), joined by the next `connect()`."""
        ...

    def forget(self, url: str) -> bool:
        """Drop `url` and never join it again (it left the run); True if it was one of ours."""
        ...

    def close(self) -> None: ...


def pause_policy(config: RunConfig) -> str:
    """How an engine that pauses around an install treats running sequences: `keep` (their KV from
    the old weights stays, PipelineRL), `recompute` (`inference.kv_policy: recompute`) or `drain`
    (`in_flight_updates: false`: they finish on the old weights first)."""
    if not config.in_flight_updates:
        return "drain"
    return "recompute" if config.inference.kv_policy == "recompute" else "keep"


def make_sender(config: RunConfig, servers: Sequence[ServerConfig] | None = None) -> WeightPusher | None:
    """The weight sender for `servers` (default: the configured ones; None when there are none):
    one per engine among them (the built-in `WeightSender`, `VLLMWeightSender`,
    `SGLangWeightSender`), behind one `WeightPusher`."""
    servers = config.inference.server_list() if servers is None else list(servers)
    if not servers:
        return None
    senders: dict[str, WeightPusher] = {}
    for engine in dict.fromkeys(str(s.engine) for s in servers):
        endpoints = [_endpoint(config, s) for s in servers if str(s.engine) == engine]
        senders[engine] = _engine_sender(config, engine, endpoints)
    return next(iter(senders.values())) if len(senders) == 1 else MultiSender(senders)


def _endpoint(config: RunConfig, server: ServerConfig) -> ServerEndpoint:
    from stream_rl.weights import ServerEndpoint

    token = config.inference.admin_token
    return ServerEndpoint(server.url, token.get_secret_value() if token is not None else None)


def engine_of(pusher: WeightPusher) -> str:
    """The engine a single-engine sender reaches (the built-in senders carry no tag)."""
    engine = getattr(pusher, "engine", "builtin")
    return engine if isinstance(engine, str) else "builtin"


def add_server(config: RunConfig, pusher: WeightPusher | None, server: ServerConfig) -> WeightPusher:
    """`pusher` with `server` added (a server that joined the run; the next `connect()` joins it):
    the sender of its engine takes it, or a new one is made (a run of one engine's senders becomes
    a `MultiSender` when a server of another engine joins)."""
    engine = str(server.engine)
    if pusher is None:
        made = make_sender(config, [server])
        assert made is not None
        return made
    if isinstance(pusher, MultiSender):
        pusher.add_server(config, server)
        return pusher
    if engine_of(pusher) == engine:
        pusher.add(_endpoint(config, server))
        return pusher
    multi = MultiSender({engine_of(pusher): pusher})
    multi.add_server(config, server)
    return multi


def _engine_sender(config: RunConfig, engine: str, endpoints: list[ServerEndpoint]) -> WeightPusher:
    tcfg = config.trainer
    addr, port, timeout_s = tcfg.sync_master_addr, tcfg.sync_master_port, tcfg.update_timeout_s
    if engine == "vllm":
        from stream_rl.weights.adapters.vllm import VLLMWeightSender

        return VLLMWeightSender(
            endpoints,
            backend=config.inference.vllm_backend(),
            pause=pause_policy(config),
            bucket_bytes=int(tcfg.bucket_mb * (1 << 20)),
            master_addr=addr,
            master_port=port,
            timeout_s=timeout_s,
        )
    if engine == "sglang":
        from stream_rl.weights.adapters.sglang import SGLangWeightSender

        return SGLangWeightSender(
            endpoints, master_addr=addr, master_port=port, timeout_s=timeout_s, pause=pause_policy(config)
        )
    from stream_rl.weights.sender_choice import make_builtin_sender

    # trainer.weight_transport (transport.py): gloo, nccl, cuda_ipc, or auto (per server, by device)
    sender: WeightPusher = make_builtin_sender(
        endpoints,
        transport=tcfg.weight_transport,
        trainer_device=tcfg.device,
        master_addr=addr,
        master_port=port,
        timeout_s=timeout_s,
        push_dtype=tcfg.push_dtype,
        delta_threshold=tcfg.push_delta_threshold,
    )
    return sender


class MultiSender:
    """Several engines' senders as one `WeightPusher` (a run whose servers mix engines), by engine."""

    def __init__(self, senders: Mapping[str, WeightPusher]) -> None:
        self.by_engine = dict(senders)

    @property
    def senders(self) -> list[WeightPusher]:
        return list(self.by_engine.values())

    def add_server(self, config: RunConfig, server: ServerConfig) -> None:
        engine = str(server.engine)
        if engine in self.by_engine:
            self.by_engine[engine].add(_endpoint(config, server))
        else:
            self.by_engine[engine] = _engine_sender(config, engine, [_endpoint(config, server)])

    def add(self, server: ServerEndpoint) -> None:
        raise WeightSyncError("MultiSender.add: use add_server, which names the server's engine")

    def forget(self, url: str) -> bool:
        return any([sender.forget(url) for sender in self.senders])

    @property
    def live_servers(self) -> list[str]:
        return [url for s in self.senders for url in s.live_servers]

    def connect(self) -> dict[str, str]:
        failures: dict[str, str] = {}
        errors = []
        for sender in self.senders:
            try:
                failures.update(sender.connect())
            except WeightSyncError as exc:
                errors.append(str(exc))
        if errors and not self.live_servers:
            raise WeightSyncError("; ".join(errors))
        return failures

    def push(
        self, version: int, named_tensors: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int
    ) -> PushOutcome:
        from stream_rl.weights.sender import PushReport

        return PushReport.combined(
            version, [s.push(version, named_tensors, bucket_bytes) for s in self.senders]
        )

    def drop(self, url: str) -> bool:
        return any([sender.drop(url) for sender in self.senders])

    def close(self) -> None:
        for sender in self.senders:
            sender.close()


def connect_servers(
    pusher: WeightPusher,
    timeout_s: float,
    stop: StopFlag,
    retry_s: float = 1.0,
    optional: Collection[str] = (),
) -> None:
    """Ask every server to join until all have, or `timeout_s` passed (servers may still be
    loading). Raises `WeightSyncError` if none joined; some missing is logged and tolerated.
    `optional` servers (those that joined the run before this start, through the `servers` topic:
    they were up then, and one that does not answer now is likely gone) are not waited for: they
    re-join when they answer `/health` (`rejoin_dropped`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            failures: Mapping[str, str] = pusher.connect()
        except WeightSyncError as exc:
            failures = {"all servers": str(exc)}
        if not failures:
            return
        if pusher.live_servers and set(failures) <= set(optional):
            log.warning(
                "servers that joined the run before this start did not join the weight sync (gone?): %s; "
                "they re-join when they answer /health",
                dict(failures),
            )
            return
        if time.monotonic() >= deadline or stop:
            if pusher.live_servers:
                log.warning("continuing without servers that did not join: %s", dict(failures))
                return
            raise WeightSyncError(
                f"no inference server joined within {timeout_s:.0f} s: "
                + "; ".join(f"{u}: {why}" for u, why in failures.items())
            )
        log.info("waiting for servers to join the weight-sync group: %s", dict(failures))
        stop.wait(retry_s)


def rejoin_dropped(pusher: WeightPusher, urls: Sequence[str], health_timeout_s: float = 1.0) -> bool:
    """Ask dropped servers to re-join, if any of them answers `GET /health` (a join with a dead
    server would cost a timeout); True when one re-joined. Failures are logged, never raised."""
    import httpx

    missing = [url for url in urls if url not in set(pusher.live_servers)]
    up = []
    if missing:
        with httpx.Client(timeout=health_timeout_s) as http:  # one SSL context, not one per server
            for url in missing:
                try:
                    if http.get(f"{url}/health").status_code == 200:
                        up.append(url)
                except httpx.HTTPError:
                    continue
    if not up:
        return False
    before = len(pusher.live_servers)
    try:
        failures = pusher.connect()
    except WeightSyncError as exc:
        log.warning("re-joining dropped servers failed: %s", exc)
        return False
    for url, why in failures.items():
        log.warning("server %s answers /health but did not re-join: %s", url, why)
    joined = len(pusher.live_servers) > before
    if joined:
        log.info(
            "re-joined %d dropped server(s); the next version goes to them", len(pusher.live_servers) - before
        )
    return joined


PROBE_TIMEOUT_S = 1.0
"""How long a server has to report the version it holds (`held_versions`)."""


def held_versions(
    servers: Sequence[ServerConfig], timeout_s: float = PROBE_TIMEOUT_S, api_key: str | None = None
) -> dict[str, int | None]:
    """url -> the weight version each server reports holding, read through its engine's own
    route (the clients' `version()`: built-in `GET /v1/models`, vLLM `GET /weight_info`, SGLang
    `GET /model_info`), all at once; None for a server that gave no usable answer within
    `timeout_s` (down, restarting, an unknown label). Never raises. `api_key`: the servers'
    OpenAI-routes key (the built-in server's `/v1/models` needs it when one is set)."""
    import asyncio

    from stream_rl.inference.clients import make_client

    async def one(server: ServerConfig) -> int | None:
        client = make_client(str(server.engine), server.url, timeout_s=timeout_s, api_key=api_key)
        try:
            return await asyncio.wait_for(client.version(), timeout_s)
        except (InferenceError, TimeoutError):
            return None
        finally:
            await client.aclose()

    async def every() -> list[int | None]:
        return list(await asyncio.gather(*(one(s) for s in servers)))

    return dict(zip([s.url for s in servers], asyncio.run(every()), strict=True))


def drop_restarted(
    pusher: WeightPusher,
    servers: Sequence[ServerConfig],
    pushed: int,
    probe: Callable[[Sequence[ServerConfig]], Mapping[str, int | None]] = held_versions,
) -> list[str]:
    """Drop every live server that reports a version older than `pushed`, the version the
    trainer last pushed to every live server: it was restarted since (a fresh instance serves its
    initial weights, version 0), so it lacks the weights and its side of the group is gone, though
    no push has failed to say so. Returns the dropped urls; `rejoin_dropped` then re-joins them and
    the caller pushes them the current version. A server that does not answer is left alone (the
    next probe or push finds it). Never raises."""
    live = set(pusher.live_servers)
    targets = [s for s in servers if s.url in live]
    if not targets:
        return []
    dropped = []
    for url, held in probe(targets).items():
        if held is None or held >= pushed:
            continue
        log.warning(
            "server %s holds version %d but was pushed version %d: it restarted since; dropping it "
            "to re-join it and push it version %d again",
            url,
            held,
            pushed,
            pushed,
        )
        if pusher.drop(url):
            dropped.append(url)
    return dropped
