"""The trainer's side of CUDA IPC weight sync (`trainer.weight_transport: cuda_ipc`): servers on
the trainer's own GPU, where NCCL cannot form a group. Protocol and buffer lifetime:
`stream_rl.weights.ipc`.

Same interface as `WeightSender` (`connect`, `push`, `live_servers`, `close`): `connect()` sends
`POST /weights/init_ipc` to every server not yet live (the server refuses unless it is on this
GPU with the same torch) and reads its `GET /weights/meta`; `push()` checks the tensors against
each server, shares the buckets once (a lone parameter's own memory, else a packed copy), then
sends every server that lacks the version its `POST /weights/update_ipc`, one after another (they
share one GPU: in parallel they would only compete for its copy engines). A server that fails is
dropped and reported; the others still get the version. The shared buffers stay alive until
every server answered, or, after a failure, until the push's deadline has passed (kept in
`_retained` and released by a later push or `close()`), so a server still copying never reads
memory the trainer freed. Parameters shared in place are not copied: a server that answers only
after the trainer's deadline (it was dropped meanwhile) may have read some of them after the next
optimizer step, and it receives the full current version when it re-joins.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import torch

from stream_rl.errors import WeightSyncError
from stream_rl.weights.buckets import TensorMeta, plan_buckets
from stream_rl.weights.group import gpu_uuid
from stream_rl.weights.ipc import pack_shared, share
from stream_rl.weights.sender import PushReport, check_against_server
from stream_rl.weights.server_client import ServerClient, ServerEndpoint

log = logging.getLogger(__name__)


@dataclass
class _IpcLink:
    client: ServerClient
    live: bool = False
    metas: dict[str, TensorMeta] | None = None
    version: int | None = None

    @property
    def url(self) -> str:
        return self.client.endpoint.url


class IpcWeightSender:
    """Weight updates to the servers on this trainer's GPU over CUDA IPC."""

    def __init__(
        self, servers: Sequence[ServerEndpoint], *, timeout_s: float = 60.0, device: str | None = None
    ) -> None:
        if not torch.cuda.is_available():
            raise WeightSyncError("trainer.weight_transport: cuda_ipc needs CUDA (use gloo on CPU)")
        if timeout_s <= 0:
            raise WeightSyncError(f"timeout_s must be positive, got {timeout_s}")
        dev = torch.device(device or f"cuda:{torch.cuda.current_device()}")
        self.index = dev.index if dev.index is not None else torch.cuda.current_device()
        self.device_uuid = gpu_uuid(self.index)
        self.timeout_s = timeout_s
        self._http = httpx.Client()
        self._links: dict[str, _IpcLink] = {}
        self._retained: list[tuple[float, list[torch.Tensor]]] = []
        self.version: int | None = None
        for server in servers:
            self.add(server)

    def add(self, server: ServerEndpoint) -> None:
        """One more server (joined by the next `connect()`)."""
        if server.url in self._links:
            raise WeightSyncError(f"duplicate server URL {server.url}")
        self._links[server.url] = _IpcLink(ServerClient(server, self._http))

    @property
    def live_servers(self) -> list[str]:
        return [url for url, link in self._links.items() if link.live]

    def connect(self) -> dict[str, str]:
        """Join every server not yet live; returns failures (url -> reason)."""
        failures: dict[str, str] = {}
        for link in self._links.values():
            if link.live:
                continue
            try:
                link.client.init_ipc(
                    device_uuid=self.device_uuid, torch_version=torch.__version__, timeout_s=self.timeout_s
                )
                link.metas = {m.name: m for m in link.client.meta(self.timeout_s)}
            except WeightSyncError as exc:
                failures[link.url] = str(exc)
                log.warning("weight sync: %s did not join over CUDA IPC: %s", link.url, exc)
                continue
            link.live, link.version = True, None
            log.info("weight sync: %s joined (cuda_ipc on %s)", link.url, self.device_uuid)
        if self._links and not self.live_servers:
            raise WeightSyncError(
                "no inference server joined over CUDA IPC: "
                + "; ".join(f"{url}: {why}" for url, why in failures.items())
            )
        return failures

    def push(
        self, version: int, named_tensors: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int
    ) -> PushReport:
        """Share `named_tensors` as `version` with every live server not already holding it."""
        self._release_expired()
        metas = [TensorMeta.from_tensor(name, tensor) for name, tensor in named_tensors]
        live = [link for link in self._links.values() if link.live]
        targets = [link for link in live if link.version != version]
        for link in targets:
            check_against_server(metas, link.metas or {}, link.url)
        report = PushReport(version=version, broadcast_ms=0.0)
        report.updated = [link.url for link in live if link.version == version]
        if targets:
            deadline = time.monotonic() + self.timeout_s
            with torch.cuda.device(self.index):
                buffers = pack_shared(
                    plan_buckets(metas, bucket_bytes), [t.detach() for _, t in named_tensors]
                )
                # The bytes are complete before any server reads them (torch also records an IPC
                # event the server's stream waits for; this makes it independent of that).
                torch.cuda.current_stream().synchronize()
                handles = [share(b) for b in buffers]
            failed = False
            for link in targets:
                start = time.perf_counter()
                try:
                    answer = link.client.update(
                        version=version,
                        metas=metas,
                        bucket_bytes=bucket_bytes,
                        timeout_s=max(deadline - time.monotonic(), 0.001),
                        ipc_buckets=handles,
                    )
                except WeightSyncError as exc:
                    failed = True
                    report.failed[link.url] = str(exc)
                    log.warning("weight sync: dropping %s from version %d on: %s", link.url, version, exc)
                    link.live, link.metas, link.version = False, None, None
                    continue
                total_ms = (time.perf_counter() - start) * 1000.0
                link.version = version
                report.updated.append(link.url)
                report.per_server[link.url] = {
                    "receive_ms": answer.receive_ms,
                    "stall_ms": answer.stall_ms,
                    "broadcast_ms": total_ms,
                    "total_ms": total_ms,
                }
                report.broadcast_ms = max(report.broadcast_ms, total_ms)
            if failed:  # a server may still be copying: keep the buffers past the deadline
                self._retained.append((deadline, buffers))
            del buffers, handles
            torch.cuda.ipc_collect()
        self.version = version
        return report

    def drop(self, url: str) -> bool:
        """Forget `url`'s join (it restarted); True if it was live. No group to release: the next
        `connect()` sends it `init_ipc` again and the next push shares it the version."""
        link = self._links.get(url)
        if link is None or not link.live:
            return False
        log.info("weight sync: dropping %s (restarted): it re-joins over CUDA IPC", url)
        link.live, link.metas, link.version = False, None, None
        return True

    def forget(self, url: str) -> bool:
        """Never share with `url` again (it left the run); True if it was one of ours."""
        return self._links.pop(url, None) is not None

    def _release_expired(self) -> None:
        now = time.monotonic()
        self._retained = [(t, b) for t, b in self._retained if t > now]

    def close(self) -> None:
        """Forget the servers and close the HTTP client (waits for retained buffers' deadlines)."""
        if self._retained:
            time.sleep(max(0.0, max(t for t, _ in self._retained) - time.monotonic()))
            self._retained = []
        for link in self._links.values():
            link.live = False
        self._http.close()

    def __enter__(self) -> IpcWeightSender:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
