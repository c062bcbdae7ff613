"""`trainer.weight_transport`: which sender reaches the built-in servers.

- `gloo`: `WeightSender(backend="gloo")`, bytes through host memory and TCP; works everywhere,
  including a CUDA trainer and a CUDA server on one GPU (the colocated fallback).
- `nccl`: `WeightSender(backend="nccl")`, GPU to GPU; the server must be on another GPU (NCCL
  refuses two ranks on one: "Duplicate GPU detected").
- `cuda_ipc`: `IpcWeightSender`, servers on the trainer's own GPU (`stream_rl.weights.ipc`).
- `auto`: gloo for a CPU trainer; for a CUDA trainer `AutoSender`, which asks each server where it
  runs (`GET /weights/device`) and picks per server: cuda_ipc on the trainer's GPU (same UUID),
  nccl on another GPU, gloo for a server on CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import httpx
import torch

from stream_rl.errors import WeightSyncError
from stream_rl.weights.group import gpu_uuid
from stream_rl.weights.sender import PushReport, WeightSender
from stream_rl.weights.server_client import ServerClient, ServerEndpoint

if TYPE_CHECKING:
    from stream_rl.weights.ipc_sender import IpcWeightSender

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "nccl", "gloo", "cuda_ipc")


def make_builtin_sender(
    servers: Sequence[ServerEndpoint],
    *,
    transport: str,
    trainer_device: str,
    master_addr: str,
    master_port: int,
    timeout_s: float,
    push_dtype: str = "trainer",
    delta_threshold: float | None = None,
) -> WeightSender | IpcWeightSender | AutoSender:
    """The sender of `transport` for built-in servers (see the module doc); each is a
    `stream_rl.train.push.WeightPusher` (checked where the trainer assigns this). `push_dtype` and
    `delta_threshold` (`stream_rl.weights.shaping`) shape what travels: gloo and nccl only."""
    if transport not in TRANSPORTS:
        raise WeightSyncError(f"weight transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    if transport in ("nccl", "cuda_ipc") and trainer_device != "cuda":
        raise WeightSyncError(f"weight transport {transport} needs a CUDA trainer (use gloo on CPU)")
    if transport == "auto":
        transport = "gloo" if trainer_device == "cpu" else "auto"
    if (push_dtype != "trainer" or delta_threshold is not None) and transport not in ("gloo", "nccl"):
        raise WeightSyncError(
            "push_dtype server and delta_threshold need weight transport gloo or nccl "
            f"(got {transport}: cuda_ipc shares the trainer's own buffers)"
        )
    if transport == "cuda_ipc":
        from stream_rl.weights.ipc_sender import IpcWeightSender

        return IpcWeightSender(servers, timeout_s=timeout_s)
    if transport == "auto":
        return AutoSender(servers, master_addr=master_addr, master_port=master_port, timeout_s=timeout_s)
    return WeightSender(
        servers,
        backend=transport,
        master_addr=master_addr,
        master_port=master_port,
        timeout_s=timeout_s,
        push_dtype=push_dtype,
        delta_threshold=delta_threshold,
    )


class AutoSender:
    """A CUDA trainer's sender that picks each server's transport from where the server runs."""

    def __init__(
        self, servers: Sequence[ServerEndpoint], *, master_addr: str, master_port: int, timeout_s: float
    ) -> None:
        self.master_addr, self.master_port, self.timeout_s = master_addr, master_port, timeout_s
        self.device_uuid = gpu_uuid(torch.cuda.current_device())
        self._unresolved = list(servers)
        self._http = httpx.Client()
        self._ipc: IpcWeightSender | None = None
        self._groups: list[WeightSender] = []  # one per batch of servers resolved together
        self.transport: dict[str, str] = {}
        """Server URL -> the transport chosen for it."""

    @property
    def _senders(self) -> list[WeightSender | IpcWeightSender]:
        return ([self._ipc] if self._ipc is not None else []) + list(self._groups)

    @property
    def live_servers(self) -> list[str]:
        return [url for sender in self._senders for url in sender.live_servers]

    def add(self, server: ServerEndpoint) -> None:
        """One more server; where it runs (and so its transport) is asked at the next `connect()`."""
        self._unresolved.append(server)

    def forget(self, url: str) -> bool:
        """Never push to `url` again (it left the run); True if it was one of ours."""
        self.transport.pop(url, None)
        unresolved = [s for s in self._unresolved if s.url == url]
        for server in unresolved:
            self._unresolved.remove(server)
        return bool(unresolved) or any([sender.forget(url) for sender in self._senders])

    def _resolve(self) -> dict[str, str]:
        failures: dict[str, str] = {}
        by_backend: dict[str, list[ServerEndpoint]] = {"nccl": [], "gloo": []}
        for server in list(self._unresolved):
            try:
                where = ServerClient(server, self._http).device(self.timeout_s)
            except WeightSyncError as exc:
                failures[server.url] = str(exc)
                continue
            self._unresolved.remove(server)
            if where.get("type") == "cuda" and where.get("uuid") == self.device_uuid:
                from stream_rl.weights.ipc_sender import IpcWeightSender

                if self._ipc is None:
                    self._ipc = IpcWeightSender([], timeout_s=self.timeout_s)
                self._ipc.add(server)
                self.transport[server.url] = "cuda_ipc"
            else:
                backend = "nccl" if where.get("type") == "cuda" else "gloo"
                by_backend[backend].append(server)
                self.transport[server.url] = backend
            log.info(
                "weight sync: %s on %s -> %s", server.url, where.get("device"), self.transport[server.url]
            )
        for backend, batch in by_backend.items():
            if batch:
                self._groups.append(
                    WeightSender(
                        batch,
                        backend=backend,
                        master_addr=self.master_addr,
                        master_port=self.master_port,
                        timeout_s=self.timeout_s,
                    )
                )
        return failures

    def connect(self) -> dict[str, str]:
        failures = self._resolve()
        errors = []
        for sender in self._senders:
            try:
                failures.update(sender.connect())
            except WeightSyncError as exc:
                errors.append(str(exc))
        if (self._unresolved or self._senders) and not self.live_servers:
            raise WeightSyncError(
                "no inference server joined: "
                + "; ".join(errors + [f"{url}: {why}" for url, why in failures.items()])
            )
        return failures

    def push(
        self, version: int, named_tensors: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int
    ) -> PushReport:
        return PushReport.combined(
            version, [s.push(version, named_tensors, bucket_bytes) for s in self._senders]
        )

    def drop(self, url: str) -> bool:
        return any([sender.drop(url) for sender in self._senders])

    def close(self) -> None:
        for sender in self._senders:
            sender.close()
        self._http.close()
