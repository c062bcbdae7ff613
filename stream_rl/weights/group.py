"""A dedicated weight-sync process group, built from a TCP store, never the default group.

`torch.distributed.init_process_group` is never called: the group is a `ProcessGroupGloo` (CPU)
or `ProcessGroupNCCL` (CUDA) constructed directly on its own `TCPStore`, so a trainer that
uses the default group for data parallelism is unaffected, and several weight groups can
coexist in one process.

Rendezvous: rank 0 (the trainer) hosts the store with `wait_for_workers=False` (its constructor
must not block: the other ranks are asked to join over HTTP afterwards), then every rank
builds the process group, which blocks until all have joined or `timeout_s` passes. Both
sides then exchange one handshake broadcast, so "joined" means a collective went through
(NCCL connects lazily otherwise).

Gloo binds its sockets to an address the peers can reach: rank 0 to `master_addr` (the address
the servers were told), the other ranks to their own address on the route to `master_addr`;
`GLOO_SOCKET_IFNAME` overrides both. The store listens on every interface (torch's choice).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from stream_rl.errors import WeightSyncError

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
_HANDSHAKE = 0x5354524D  # arbitrary tag: both sides check it, so a crossed wire fails loudly
_PORT_SEARCH = 256
# NCCL's watchdog may tear the whole process down when an operation outlives the group's
# timeout; the sender aborts a stuck group at its own deadline, so the group timeout is set
# well beyond it (unverified here: there is no GPU on the development machine).
_NCCL_TIMEOUT_FACTOR = 2.0
_NCCL_TIMEOUT_MARGIN_S = 60.0


# torch's stubs declare the backends without their collectives (broadcast), hence Any.
_Backend = Any


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise WeightSyncError(f"weight-sync backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
        raise WeightSyncError("the nccl weight-sync backend needs CUDA; use gloo on CPU")


def host_store(addr: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The store of a new group, hosted here as rank 0; returns immediately.

    `port` 0 takes any free port; otherwise the first free port from `port` upwards.
    """
    ports = [0] if port == 0 else range(port, min(port + _PORT_SEARCH, 65536))
    last: Exception | None = None
    for candidate in ports:
        try:
            return dist.TCPStore(
                addr,
                candidate,
                world_size,
                True,
                timeout=timedelta(seconds=timeout_s),
                wait_for_workers=False,
            )
        except dist.DistNetworkError as exc:  # port taken: try the next one
            last = exc
    raise WeightSyncError(f"cannot host a weight-sync store on {addr} from port {port}: {last}") from last


def cuda_device(device: str | torch.device) -> torch.device:
    """`device` with an explicit index (`cuda` -> `cuda:<current>`); CPU devices unchanged."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def gpu_uuid(index: int) -> str:
    """The GPU's UUID as `nvidia-smi -L` spells it (`GPU-...`): equal in every process on that GPU,
    whatever `CUDA_VISIBLE_DEVICES` numbering each sees."""
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


def on_stream(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[Any]:
    """`torch.cuda.stream(stream)` (which also selects the stream's device), or nothing on CPU."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def local_address_towards(addr: str) -> str:
    """This host's address on the route to `addr` (no packet is sent)."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise WeightSyncError(f"cannot find a local address that reaches {addr}: {exc}") from exc


class SyncGroup:
    """One rank's membership of a weight-sync group: broadcasts from rank 0."""

    def __init__(
        self,
        store: dist.Store,
        *,
        rank: int,
        world_size: int,
        backend: str,
        timeout_s: float,
        local_addr: str,
        device: str = "cpu",
    ) -> None:
        """Build the process group on `store` (blocks until every rank joined), then handshake."""
        check_backend(backend)
        if not 0 <= rank < world_size:
            raise WeightSyncError(f"rank {rank} is outside a group of {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self.device = torch.device("cpu") if backend == "gloo" else cuda_device(device)
        self._store: dist.Store | None = store
        self._staging: dict[int, torch.Tensor] = {}
        # NCCL: the handshake (and so the communicator's first kernels) runs on a stream of its
        # own, so that joining never makes the default stream (an engine's decode) wait.
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        try:
            with on_stream(self.stream):
                self._pg: _Backend | None = self._build(store, local_addr)
                marker = torch.tensor([_HANDSHAKE if rank == 0 else 0], dtype=torch.int64, device=self.device)
                self.broadcast(marker, timeout_s).wait()
                got = int(marker.item())  # on the same stream as the wait: ordered after the broadcast
        except (RuntimeError, ValueError) as exc:  # torch.distributed raises RuntimeError subclasses
            self.close()
            raise WeightSyncError(
                f"could not form the weight-sync group ({backend}, rank {rank}): {exc}"
            ) from exc
        if got != _HANDSHAKE:
            self.close()
            raise WeightSyncError(f"weight-sync handshake mismatch: got {got:#x}")

    def _build(self, store: dist.Store, local_addr: str) -> _Backend:
        if self.backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in torch's stubs
            opts._timeout = timedelta(seconds=self.timeout_s)
            ifname = os.environ.get("GLOO_SOCKET_IFNAME")
            device = (
                dist.ProcessGroupGloo.create_device(interface=ifname)
                if ifname
                else dist.ProcessGroupGloo.create_device(hostname=local_addr)
            )
            opts._devices = [device]
            return dist.ProcessGroupGloo(store, self.rank, self.world_size, opts)
        # On an NCCL error or timeout, abort the communicator without tearing the process down
        # (torch's default, 3, kills it): a server must outlive a dead trainer. The user's own
        # setting wins. Read when the group is built.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = timedelta(seconds=self.timeout_s * _NCCL_TIMEOUT_FACTOR + _NCCL_TIMEOUT_MARGIN_S)
        return dist.ProcessGroupNCCL(store, self.rank, self.world_size, nccl_opts)

    def broadcast(self, tensor: torch.Tensor, timeout_s: float) -> dist.Work:
        """Start broadcasting `tensor` from rank 0 (in place on the other ranks).

        The returned work fails once `timeout_s` passes (gloo), so a stuck peer never holds
        a thread forever.
        """
        if self._pg is None:
            raise WeightSyncError("the weight-sync group is closed")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if self.backend == "gloo":
            opts.timeout = timedelta(seconds=max(timeout_s, 0.001))
        return self._pg.broadcast([tensor], opts)

    def staging(self, slot: int, nbytes: int) -> torch.Tensor:
        """A reusable 1-D uint8 buffer of `nbytes` on the group's device, one per `slot`.

        Kept across updates: allocating (and first touching) fresh buffers every update costs
        more than the copies themselves for small models. The caller must not reuse a slot
        while a collective on it is pending.
        """
        buffer = self._staging.get(slot)
        if buffer is None or buffer.numel() < nbytes:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._staging[slot] = buffer
        return buffer[:nbytes]

    @property
    def closed(self) -> bool:
        return self._pg is None

    def abort(self) -> None:
        """Abort pending operations where the backend can (NCCL); gloo ends them at their timeout."""
        if self._pg is not None and self.backend == "nccl":
            self._pg.abort()

    def close(self) -> None:
        """Drop the group and its store.

        With gloo operations still pending, the last reference's release blocks until they time
        out: release groups with pending work off the caller's thread (the sender does).
        """
        self._pg = None
        self._store = None
        self._staging = {}
