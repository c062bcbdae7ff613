"""The trainer's side of weight sync: join the inference servers, push versions in buckets.

Usage (rank 0 of the trainer; the default process group, if any, is never touched):

    sender = WeightSender([ServerEndpoint(url, token)], master_port=0, backend="gloo")
    sender.connect()                         # every server joins; failures are returned
    report = sender.push(version, list(model.named_parameters()), bucket_bytes)
    ...                                      # later: sender.connect() re-joins dropped servers,
    sender.push(version, ...)                # and a push of the current version reaches only them
    sender.close()

`add(endpoint)` and `forget(url)` change the servers during a run (servers joining and leaving it:
`stream_rl.kafka.servers_topic`); the next `connect()` joins an added one.

Topology: **one group per server** (world size 2: the trainer is rank 0, the server rank 1),
each on its own TCP store and port, rather than one group shared by all servers.
- Why: a dead or hung server breaks only its own group. A shared group stalls every member's
  collective until the timeout and must then be rebuilt by all survivors (a new store, every
  server re-joining over HTTP, NCCL communicators re-created); here the others never notice,
  and a restarted server re-joins alone.
- Cost: the trainer sends the bytes once per server (N x its egress; a shared NCCL group
  would pipeline one copy through a ring), packs each bucket once per server (a memcpy, so
  that servers progress independently and a stuck one never holds back the others' buffers),
  and holds one TCP store and two pack buffers per server. With the few servers of one
  trainer this is cheap; many servers per trainer would want a shared group or a relay tree.

Per push, for every live server not already at `version` (one thread each):
`POST /weights/update` starts, then the buckets are broadcast (two in flight, packed while
the previous one travels), then the answer is awaited. Everything must finish within
`timeout_s` of the push's start; every collective carries that deadline, so a stuck peer
cannot hold a thread beyond it. A server that fails (unreachable, non-2xx answer, broadcast
error, deadline) is dropped: reported in `PushReport.failed`, removed from `live_servers`, its
group released in the background. The others still get the version. Before anything is sent,
the tensors are checked against each server's `GET /weights/meta` (names, dtypes, shapes);
a mismatch raises `WeightSyncError` and nothing is broadcast.

Smaller pushes (`push_dtype="server"`: cast to each server's dtype; `delta_threshold`: only the
tensors that moved since the version a server holds): `stream_rl.weights.shaping`; each server's
`per_server` figures then also say the `bytes` and `tensors` it was sent.

Versions are idempotent per server: a push skips servers that already acknowledged that
version, so after `connect()` re-joins a restarted server, pushing the current version again
re-broadcasts it to that server only.

Ports: `master_port` 0 gives every group a free port; otherwise each group takes the first
free port from `master_port` upwards. Not thread-safe: call from one thread.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch

from stream_rl.errors import WeightSyncError
from stream_rl.weights.broadcast import send_buckets
from stream_rl.weights.buckets import TensorMeta, plan_buckets
from stream_rl.weights.group import SyncGroup, check_backend, host_store
from stream_rl.weights.lora import adapters_of
from stream_rl.weights.lora_push import push_adapters
from stream_rl.weights.server_client import ServerClient, ServerEndpoint, UpdateAnswer
from stream_rl.weights.shaping import HeldWeights, cast_to, check_push_options, server_dtypes

__all__ = ["PushReport", "ServerEndpoint", "WeightSender"]

log = logging.getLogger(__name__)

_GRACE_S = 2.0  # beyond the deadline, for threads to notice it and report


@dataclass
class PushReport:
    """The outcome of one push.

    `updated`: servers now holding `version` (including those that already did); `failed`:
    server -> reason, each dropped from the group; `per_server`: for servers sent this push,
    `receive_ms` and `stall_ms` (the server's figures), `broadcast_ms` and `total_ms` (ours).
    `broadcast_ms`: the longest broadcast among the updated servers.
    """

    version: int
    broadcast_ms: float
    updated: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    per_server: dict[str, dict[str, float]] = field(default_factory=dict)

    @classmethod
    def combined(cls, version: int, parts: Sequence[Any]) -> PushReport:
        """One report for a push made by several senders (each part a report of `version`)."""
        report = cls(version=version, broadcast_ms=0.0)
        for part in parts:
            report.updated += part.updated
            report.failed.update(part.failed)
            report.per_server.update(part.per_server)
            report.broadcast_ms = max(report.broadcast_ms, part.broadcast_ms)
        return report


@dataclass
class _Link:
    client: ServerClient
    group: SyncGroup | None = None
    metas: dict[str, TensorMeta] | None = None
    version: int | None = None

    @property
    def url(self) -> str:
        return self.client.endpoint.url


@dataclass(frozen=True)
class _Outcome:
    timings: dict[str, float] | None
    error: str | None = None


class WeightSender:
    """Rank 0 of one weight-sync group per inference server."""

    def __init__(
        self,
        servers: Sequence[ServerEndpoint],
        *,
        master_addr: str = "127.0.0.1",
        master_port: int,
        backend: str = "gloo",
        timeout_s: float = 60.0,
        device: str | None = None,
        push_dtype: str = "trainer",
        delta_threshold: float | None = None,
    ) -> None:
        """`device`: the CUDA device of the NCCL groups (default: the current one); unused by gloo.
        `push_dtype` ("trainer" or "server": cast to each server's dtype) and `delta_threshold`
        (None: every tensor every version): smaller pushes, `stream_rl.weights.shaping`."""
        check_backend(backend)
        check_push_options(push_dtype, delta_threshold)
        self.push_dtype = push_dtype
        self._held = HeldWeights(delta_threshold) if delta_threshold is not None else None
        urls = [s.url for s in servers]
        if len(set(urls)) != len(urls):
            raise WeightSyncError(f"duplicate server URLs in {urls}")
        if timeout_s <= 0:
            raise WeightSyncError(f"timeout_s must be positive, got {timeout_s}")
        self.master_addr = master_addr
        self.master_port = master_port
        self.backend = backend
        self.timeout_s = timeout_s
        self.device = device or (f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu")
        self._http = httpx.Client()
        self._links = {s.url: _Link(ServerClient(s, self._http)) for s in servers}
        self._releasers: list[threading.Thread] = []
        self.version: int | None = None
        """The last version pushed."""

    @property
    def live_servers(self) -> list[str]:
        """Servers currently in a group with the trainer."""
        return [url for url, link in self._links.items() if link.group is not None]

    # -- joining -----------------------------------------------------------------------------

    def add(self, server: ServerEndpoint) -> None:
        """One more server (one that joined the run), joined by the next `connect()`."""
        if server.url in self._links:
            raise WeightSyncError(f"duplicate server URL {server.url}")
        self._links[server.url] = _Link(ServerClient(server, self._http))

    def forget(self, url: str) -> bool:
        """Take `url` out of its group (between pushes) and never join it again: it left the run.
        True if it was one of ours."""
        link = self._links.pop(url, None)
        if link is None:
            return False
        self._drop(link)
        return True

    def connect(self) -> dict[str, str]:
        """Make every server that is not live join its group; returns failures (url -> reason).

        Servers join concurrently, each within `timeout_s`. A server that fails stays out and
        can be retried by a later call. Raises `WeightSyncError` if no server is live afterwards.
        """
        targets = [link for link in self._links.values() if link.group is None]
        failures: dict[str, str] = {}
        if targets:
            pool = cf.ThreadPoolExecutor(max_workers=2 * len(targets), thread_name_prefix="weights-join")
            try:
                joins = {link.url: self._start_join(link, pool) for link in targets}
                for link in targets:
                    error = self._finish_join(link, *joins[link.url])
                    if error is not None:
                        failures[link.url] = error
                        log.warning("weight sync: %s did not join: %s", link.url, error)
            finally:
                pool.shutdown(wait=False, cancel_futures=True)
        if self._links and not self.live_servers:
            raise WeightSyncError(
                "no inference server joined the weight-sync group: "
                + "; ".join(f"{url}: {why}" for url, why in failures.items())
            )
        return failures

    def _start_join(
        self, link: _Link, pool: cf.ThreadPoolExecutor
    ) -> tuple[cf.Future[SyncGroup] | None, cf.Future[None] | None, str | None]:
        try:
            store = host_store(self.master_addr, self.master_port, 2, self.timeout_s)
        except WeightSyncError as exc:
            return None, None, str(exc)
        group = pool.submit(
            SyncGroup,
            store,
            rank=0,
            world_size=2,
            backend=self.backend,
            timeout_s=self.timeout_s,
            local_addr=self.master_addr,
            device=self.device,
        )
        request = pool.submit(
            link.client.init_group,
            master_addr=self.master_addr,
            master_port=store.port,
            rank=1,
            world_size=2,
            backend=self.backend,
            timeout_s=self.timeout_s,
        )
        return group, request, None

    def _finish_join(
        self,
        link: _Link,
        group_future: cf.Future[SyncGroup] | None,
        request: cf.Future[None] | None,
        error: str | None,
    ) -> str | None:
        if group_future is None or request is None:
            return error
        pending: list[cf.Future[Any]] = [group_future, request]
        done, _ = cf.wait(pending, timeout=self.timeout_s + _GRACE_S, return_when=cf.FIRST_EXCEPTION)
        for future in (request, group_future):  # the server's own answer explains more
            if future in done and future.exception() is not None:
                return str(future.exception())
        if len(done) < len(pending):
            return f"did not join within {self.timeout_s:.1f} s"
        group = group_future.result()
        link.group = group
        try:
            link.metas = {m.name: m for m in link.client.meta(self.timeout_s)}
        except WeightSyncError as exc:
            self._drop(link)
            return str(exc)
        link.version = None  # a (re-)joined server holds nothing we pushed
        log.info("weight sync: %s joined (%s)", link.url, self.backend)
        return None

    # -- pushing -----------------------------------------------------------------------------

    def push(
        self, version: int, named_tensors: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int
    ) -> PushReport:
        """Broadcast `named_tensors` as `version` to every live server not already holding it.

        Blocks until every such server installed it or was dropped (at most ~`timeout_s`).
        Raises `WeightSyncError`, before anything is sent, if the tensors do not match a server's.
        A LoRA trainer's version (`stream_rl.weights.lora.MergedWeights`) travels as its adapters.
        """
        lora = adapters_of(named_tensors)
        if lora is not None:
            return push_adapters(
                self, version, lora, bucket_bytes, PushReport(version=version, broadcast_ms=0.0)
            )
        live = [link for link in self._links.values() if link.group is not None]
        targets = [link for link in live if link.version != version]
        if self.push_dtype == "server" and targets:
            dtypes = server_dtypes([n for n, _ in named_tensors], {t.url: t.metas or {} for t in targets})
            named_tensors = cast_to(named_tensors, dtypes)
        metas = [TensorMeta.from_tensor(name, tensor) for name, tensor in named_tensors]
        names = [m.name for m in metas]
        if len(set(names)) != len(names):
            raise WeightSyncError("duplicate tensor names in the update")
        for link in targets:
            check_against_server(metas, link.metas or {}, link.url)
        sends = self._sends(version, named_tensors, targets) if targets else {}
        report = PushReport(version=version, broadcast_ms=0.0)
        report.updated = [link.url for link in live if link.version == version]
        if targets:
            deadline = time.monotonic() + self.timeout_s
            pool = cf.ThreadPoolExecutor(max_workers=2 * len(targets), thread_name_prefix="weights-push")
            try:
                futures = {}
                for link in targets:
                    sent = sends[link.url]
                    sent_metas = [TensorMeta.from_tensor(n, t) for n, t in sent]
                    futures[link.url] = pool.submit(
                        self._deliver,
                        link,
                        version,
                        sent_metas,
                        plan_buckets(sent_metas, bucket_bytes),
                        [t.detach() for _, t in sent],
                        bucket_bytes,
                        deadline,
                        pool,
                    )
                cf.wait(futures.values(), timeout=self.timeout_s + 2 * _GRACE_S)
            finally:
                pool.shutdown(wait=False, cancel_futures=True)
            for link in targets:
                future = futures[link.url]
                outcome = future.result() if future.done() else _Outcome(None, "delivery did not finish")
                if outcome.timings is not None:
                    link.version = version
                    report.updated.append(link.url)
                    report.per_server[link.url] = outcome.timings
                    report.broadcast_ms = max(report.broadcast_ms, outcome.timings["broadcast_ms"])
                else:
                    reason = outcome.error or "unknown failure"
                    report.failed[link.url] = reason
                    log.warning("weight sync: dropping %s from version %d on: %s", link.url, version, reason)
                    self._drop(link)
        self.version = version
        return report

    def _sends(
        self, version: int, named: Sequence[tuple[str, torch.Tensor]], targets: Sequence[_Link]
    ) -> dict[str, Sequence[tuple[str, torch.Tensor]]]:
        """url -> the tensors to send it: all of them, or with a delta threshold, the ones that moved
        since the held version to a server holding it and the whole held copy to the others."""
        held = self._held
        if held is None:
            return {link.url: named for link in targets}
        before = held.version
        changed = held.advance(version, named) if before != version else None
        return {
            link.url: held.named(changed) if changed is not None and link.version == before else held.named()
            for link in targets
        }

    def _deliver(
        self,
        link: _Link,
        version: int,
        metas: list[TensorMeta],
        plan: list[list[TensorMeta]],
        sources: list[torch.Tensor],
        bucket_bytes: int,
        deadline: float,
        pool: cf.ThreadPoolExecutor,
    ) -> _Outcome:
        """One server's update, on its own thread; never raises (the outcome says why)."""
        group = link.group
        if group is None:
            return _Outcome(None, "not in a group")
        start = time.perf_counter()
        wake = threading.Event()
        request = pool.submit(
            link.client.update,
            version=version,
            metas=metas,
            bucket_bytes=bucket_bytes,
            timeout_s=deadline - time.monotonic(),
        )
        request.add_done_callback(lambda _f: wake.set())
        try:
            send_buckets(
                group, plan, sources, deadline=deadline, abort=lambda: _request_failure(request), wake=wake
            )
            broadcast_ms = (time.perf_counter() - start) * 1000.0
            answer = request.result(timeout=max(deadline - time.monotonic(), 0.0))
        except cf.TimeoutError:
            return _Outcome(None, f"no answer to the update within {self.timeout_s:.1f} s")
        except WeightSyncError as exc:
            return _Outcome(None, str(exc))
        total_ms = (time.perf_counter() - start) * 1000.0
        return _Outcome(
            {
                "receive_ms": answer.receive_ms,
                "stall_ms": answer.stall_ms,
                "broadcast_ms": broadcast_ms,
                "total_ms": total_ms,
                "bytes": float(sum(m.nbytes for m in metas)),
                "tensors": float(len(metas)),
            }
        )

    # -- teardown ----------------------------------------------------------------------------

    def drop(self, url: str) -> bool:
        """Take `url` out of its group between pushes (the trainer found it restarted: its side of
        the group is gone though no push failed); True if it was live. The group is released off
        the caller's thread, as after a failed push; `connect()` then re-joins it in a new group,
        and the next push sends it the version."""
        link = self._links.get(url)
        if link is None or link.group is None:
            return False
        log.info("weight sync: dropping %s (restarted): it re-joins in a new group", url)
        self._drop(link)
        return True

    def _drop(self, link: _Link, *, pending: bool = True) -> None:
        """Take a server out of its group.

        A gloo group with an operation still pending blocks its release until that operation's
        timeout (the push's deadline), which the caller must not wait for: unless the caller
        knows nothing is pending, the group is released on a background thread.
        """
        group, link.group = link.group, None
        link.metas = None
        link.version = None
        if group is None:
            return
        group.abort()
        if not pending:
            group.close()
            return
        holder = [group]
        del group
        releaser = threading.Thread(target=holder.clear, name="weights-release", daemon=True)
        releaser.start()
        self._releasers = [t for t in self._releasers if t.is_alive()] + [releaser]

    def close(self) -> None:
        """Leave every group and close the HTTP client. Safe to call twice.

        Blocks until groups dropped by a recent push are torn down (at most until that push's
        deadline).
        """
        for link in self._links.values():
            self._drop(link, pending=False)  # live groups: every push ended, nothing pending
        # Dropped groups end their pending operations by the deadline of the push that dropped
        # them; a process exiting while one is being torn down would abort, so wait for them.
        for releaser in self._releasers:
            releaser.join(timeout=self.timeout_s + _GRACE_S)
        self._releasers = []
        self._http.close()

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def _request_failure(request: cf.Future[UpdateAnswer]) -> str | None:
    if request.done() and request.exception() is not None:
        return f"update request failed during the broadcast: {request.exception()}"
    return None


def check_against_server(metas: Sequence[TensorMeta], server: dict[str, TensorMeta], url: str) -> None:
    """Raise `WeightSyncError` naming what differs between the update and the server's weights."""
    ours = {m.name: m for m in metas}
    missing = [name for name in server if name not in ours]
    unexpected = [name for name in ours if name not in server]
    different = [
        f"{name}: {meta.describe()} here, {server[name].describe()} on the server"
        for name, meta in ours.items()
        if name in server and server[name] != meta
    ]
    if not (missing or unexpected or different):
        return
    parts = []
    for label, items in (
        ("missing", missing),
        ("unknown to the server", unexpected),
        ("mismatched", different),
    ):
        if items:
            shown = ", ".join(items[:3]) + (f", ... ({len(items) - 3} more)" if len(items) > 3 else "")
            parts.append(f"{len(items)} {label} ({shown})")
    raise WeightSyncError(f"the update does not match the weights of {url}: " + "; ".join(parts))
