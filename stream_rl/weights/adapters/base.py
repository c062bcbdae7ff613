"""What the vLLM and SGLang adapters share: the `WeightSender` interface over engine-specific calls.

An adapter is a trainer-side sender (`connect`, `push`, `close`, `live_servers`, `PushReport`)
for servers that are not ours: it drives the engine's own documented weight-update HTTP API
and its own trainer-side group helper. As with `WeightSender`, every server gets its own group
(the trainer is rank 0, the server's workers the other ranks), so a failing server is dropped
alone; a push skips servers already at its version, so re-pushing the current version after
`connect()` re-joins a restarted server reaches that server only.

Subclasses implement `_join(server, port)` (both sides of the group; returns the trainer's
handle), `_update(server, handle, version, named_tensors, bucket_bytes)` (returns
`receive_ms` and `stall_ms`) and optionally `_release(handle)`. Each runs on a worker thread
with `timeout_s` to finish; a server that fails or overruns is dropped and reported. An NCCL
collective stuck on a dead peer cannot be interrupted from Python: its thread is abandoned
(GPU only, unverified here).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from stream_rl.common.ports import free_port
from stream_rl.contracts.core import INCOMPLETE
from stream_rl.errors import WeightSyncError
from stream_rl.weights.sender import PushReport
from stream_rl.weights.server_client import ServerEndpoint

__all__ = ["INCOMPLETE", "EngineSender", "dtype_name", "require_cuda"]

log = logging.getLogger(__name__)


def require_cuda(engine: str) -> None:
    if not torch.cuda.is_available():
        raise WeightSyncError(f"the {engine} adapter needs CUDA (its weights travel over NCCL)")


@dataclass
class _Server:
    endpoint: ServerEndpoint
    handle: Any = None
    version: int | None = None


class EngineSender(ABC):
    """Base of the engine adapters: per-server groups, deadlines, dropping, version skipping."""

    engine = "engine"

    def __init__(
        self,
        servers: Sequence[ServerEndpoint],
        *,
        master_addr: str = "127.0.0.1",
        master_port: int = 0,
        timeout_s: float = 300.0,
    ) -> None:
        self.master_addr = master_addr
        self.master_port = master_port
        self.timeout_s = timeout_s
        # No keep-alive: vLLM (uvicorn) closes a connection after a 500, and a pooled connection
        # closed that way fails the next call; a few calls per update need no pool.
        self.http = httpx.Client(timeout=timeout_s, limits=httpx.Limits(max_keepalive_connections=0))
        self._servers = {s.url: _Server(s) for s in servers}
        self._next_port = master_port

    @property
    def live_servers(self) -> list[str]:
        return [url for url, s in self._servers.items() if s.handle is not None]

    def call(
        self, server: ServerEndpoint, method: str, path: str, *, missing_ok: bool = False, **kwargs: Any
    ) -> Any:
        """One HTTP call to the engine; non-2xx raises `WeightSyncError` (404 returns None if `missing_ok`)."""
        headers = {"Authorization": f"Bearer {server.admin_token}"} if server.admin_token else {}
        url = f"{server.base}{path}"
        try:
            response = self.http.request(method, url, headers=headers, **kwargs)
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
        if response.status_code == 404 and missing_ok:
            return None
        if response.status_code >= 300:
            raise WeightSyncError(f"{method} {url}: HTTP {response.status_code}: {response.text[:300]}")
        return response.json() if response.content else None

    def _port(self) -> int:
        if self.master_port == 0:
            return free_port(self.master_addr)
        port, self._next_port = self._next_port, self._next_port + 1
        return port

    def add(self, server: ServerEndpoint) -> None:
        """One more server (one that joined the run), joined by the next `connect()`."""
        if server.url in self._servers:
            raise WeightSyncError(f"duplicate server URL {server.url}")
        self._servers[server.url] = _Server(server)

    def forget(self, url: str) -> bool:
        """Release `url`'s group (between pushes) and never join it again: it left the run."""
        server = self._servers.pop(url, None)
        if server is None:
            return False
        self._drop(server)
        return True

    def connect(self) -> dict[str, str]:
        """Every server not in a group joins one; returns failures. Raises if none is live."""
        targets = [s for s in self._servers.values() if s.handle is None]
        failures: dict[str, str] = {}
        pool = cf.ThreadPoolExecutor(
            max_workers=max(len(targets), 1), thread_name_prefix=f"{self.engine}-join"
        )
        try:
            futures = {s.endpoint.url: pool.submit(self._join, s.endpoint, self._port()) for s in targets}
            for server in targets:
                try:
                    server.handle = futures[server.endpoint.url].result(timeout=self.timeout_s)
                    server.version = None
                except (cf.TimeoutError, WeightSyncError) as exc:
                    failures[server.endpoint.url] = str(exc) or "did not join in time"
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        if self._servers and not self.live_servers:
            raise WeightSyncError(f"no {self.engine} server joined: {failures}")
        return failures

    def push(
        self, version: int, named_tensors: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int
    ) -> PushReport:
        """Send `version` to every live server not already at it, one after another."""
        report = PushReport(version=version, broadcast_ms=0.0)
        for url, server in self._servers.items():
            if server.handle is None:
                continue
            if server.version == version:
                report.updated.append(url)
                continue
            start = time.perf_counter()
            pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.engine}-push")
            try:
                timings = pool.submit(
                    self._update, server.endpoint, server.handle, version, named_tensors, bucket_bytes
                ).result(timeout=self.timeout_s)
            except (cf.TimeoutError, WeightSyncError) as exc:
                report.failed[url] = str(exc) or f"no update within {self.timeout_s:.0f} s"
                log.warning("%s weight sync: dropping %s: %s", self.engine, url, report.failed[url])
                self._drop(server)
                continue
            finally:
                pool.shutdown(wait=False, cancel_futures=True)
            elapsed = (time.perf_counter() - start) * 1000.0
            server.version = version
            report.updated.append(url)
            report.per_server[url] = {**timings, "total_ms": elapsed}
            report.broadcast_ms = max(report.broadcast_ms, elapsed)
        return report

    def drop(self, url: str) -> bool:
        """Take `url` out of its group between pushes (it restarted: its side of the group is
        gone); True if it was live. Released as after a failed update (off this thread: a group
        whose peer died may block its release); `connect()` then re-joins it afresh."""
        server = self._servers.get(url)
        if server is None or server.handle is None:
            return False
        log.info("%s weight sync: dropping %s (restarted): it re-joins in a new group", self.engine, url)
        self._drop(server)
        return True

    def _drop(self, server: _Server, *, pending: bool = True) -> None:
        handle, server.handle, server.version = server.handle, None, None
        if handle is not None:
            self._release(handle, pending=pending)

    def close(self) -> None:
        for server in self._servers.values():
            self._drop(server, pending=False)  # every push ended: nothing is pending
        self.http.close()

    def __enter__(self) -> EngineSender:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- engine-specific ---------------------------------------------------------------------

    def _release(self, handle: Any, *, pending: bool) -> None:  # noqa: B027 (an optional hook)
        """Let go of a dropped server's group (default: nothing to do). `pending`: a collective
        may still be pending on it (then it must not block the caller)."""

    @abstractmethod
    def _join(self, server: ServerEndpoint, port: int) -> Any:
        """Make the server and this process form a group on `port`; return the trainer's handle."""

    @abstractmethod
    def _update(
        self,
        server: ServerEndpoint,
        handle: Any,
        version: int,
        named_tensors: Sequence[tuple[str, torch.Tensor]],
        bucket_bytes: int,
    ) -> dict[str, float]:
        """Send `named_tensors` as `version` over `handle`; return `receive_ms` and `stall_ms`."""


def dtype_name(tensor: torch.Tensor) -> str:
    """`torch.bfloat16` -> `bfloat16`, the spelling both engines parse."""
    return str(tensor.dtype).removeprefix("torch.")
