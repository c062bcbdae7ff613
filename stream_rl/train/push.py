"""The trainer's view of weight sync: which servers, how to join them, what a push reports.

The real sender is `stream_rl.weights.WeightSender`; the stage only needs the `WeightPusher`
shape below, so unit tests pass a hand-written fake. Servers are `inference.servers` when set,
else the launched ones, `http://{inference.host}:{inference.base_port + i}` for
`i < inference.num_servers`. Zero servers is allowed: the trainer then only publishes versions
(replays, tests, offline training).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from stream_rl.config import RunConfig
from stream_rl.errors import WeightSyncError
from stream_rl.kafka.stage import StopFlag

log = logging.getLogger(__name__)


class PushOutcome(Protocol):
    version: int
    broadcast_ms: float
    updated: list[str]
    failed: dict[str, str]
    per_server: dict[str, dict[str, float]]


class WeightPusher(Protocol):
    @property
    def live_servers(self) -> list[str]: ...

    def connect(self) -> dict[str, str]:
        """Join every server not yet joined; returns failures (url -> reason)."""
        ...

    def push(
        self, version: int, named_tensors: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int
    ) -> PushOutcome: ...

    def close(self) -> None: ...


def server_urls(config: RunConfig) -> list[str]:
    inf = config.inference
    if inf.servers:
        return [s.url.rstrip("/") for s in inf.servers]
    return [f"http://{inf.host}:{inf.base_port + i}" for i in range(inf.num_servers)]


def make_sender(config: RunConfig) -> WeightPusher | None:
    """The weight sender for the configured servers (None when there are none)."""
    urls = server_urls(config)
    if not urls:
        return None
    from stream_rl.weights import ServerEndpoint, WeightSender

    token = config.inference.admin_token
    secret = token.get_secret_value() if token is not None else None
    tcfg = config.trainer
    sender: WeightPusher = WeightSender(
        [ServerEndpoint(url, secret) for url in urls],
        master_addr=tcfg.sync_master_addr,
        master_port=tcfg.sync_master_port,
        backend="nccl" if tcfg.device == "cuda" else "gloo",
        timeout_s=tcfg.update_timeout_s,
    )
    return sender


def connect_servers(pusher: WeightPusher, timeout_s: float, stop: StopFlag, retry_s: float = 1.0) -> None:
    """Ask every server to join until all have, or `timeout_s` passed (servers may still be
    loading). Raises `WeightSyncError` if none joined; some missing is logged and tolerated."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            failures: Mapping[str, str] = pusher.connect()
        except WeightSyncError as exc:
            failures = {"all servers": str(exc)}
        if not failures:
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
