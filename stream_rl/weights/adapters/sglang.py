"""SGLang adapter: the trainer's `WeightPusher` over SGLang 0.5.23's weight-update HTTP API.

UNVERIFIED: written to the API as read from the 0.5.23 wheel (file:line below, inside it), never
run (no GPU, no SGLang on our machines). Weights travel over NCCL; needs CUDA. Every call carries
`Authorization: Bearer <admin token>` when one is set (the launcher starts SGLang with
`--admin-api-key`, which guards exactly these routes, utils/auth.py:133-143).

Join (`connect()`), per server:
1. `GET /server_info` (flat resolved server args, http_server.py:863-894): refuse `dp_size` != 1
   (SGLang asserts it for this API, tokenizer_control_mixin.py:451-453) and `pp_size` != 1 (worker
   rank is `rank_offset + tp_rank`, model_runner_components/weight_updater.py:124, so pipeline
   stages would collide); `tp_size` workers join. (`/get_server_info` is its deprecated alias.)
2. Recover what a dead trainer may have left: `POST /end_weight_update` closes a weight-update
   session left open (400 "no weight-update session is open" when there is none,
   scheduler_components/weight_updater.py:323-335). If one was open the weights may be half
   updated: `POST /update_weight_version {"new_version": "stream-rl-incomplete",
   "abort_all_requests": false}` (http_server.py:1527-1556) labels them so, and our clients refuse
   tokens sampled under that label until the next update sets a version. Then
   `POST /continue_generation` undoes a pause left behind (harmless when not paused).
3. `POST /init_weights_update_group {master_address, master_port, rank_offset: 1, world_size:
   tp + 1, group_name, backend: "nccl"}` (io_struct.py:2126-2139) while this process joins the
   group as rank 0 (`sglang_group.join_group`, with our rendezvous timeout). Group names are
   `stream-rl-<random>-<n>`: unique per trainer process, since a server never accepts a name twice.

Update (`push()`), per server, one after another; the pause follows `push.pause_policy`:
- keep: `POST /pause_generation {"mode": "in_place"}`: running requests stay in the batch with
  their KV cache from the old weights (PipelineRL's semantics; io_struct.py:1927-1946).
- recompute: `{"mode": "retract"}`: running requests go back to the queue; their KV is recomputed
  under the new weights after `/continue_generation` (scheduler.py:5817-5890).
- drain: `POST /begin_weight_update` first, unpaused: SGLang takes its model-update writer lock,
  which waits until every running request has finished (each holds the reader lock for its whole
  life, tokenizer_manager.py:938-956) and holds new ones; then `{"mode": "retract"}`, so a request
  admitted in the gap is recomputed under the new weights rather than mixing them.
Then `POST /begin_weight_update` (keep, recompute), one `POST /update_weights_from_distributed
{names, dtypes, shapes, group_name, flush_cache: false, load_format: "flattened_bucket"}` per
bucket of at most `bucket_bytes` (one broadcast each, io_struct.py:2002-2017), the last one with
`weight_version: "<version>"` (SGLang relabels when it succeeds: the spans of running requests
split there, scheduler.py:5636-5655), `POST /end_weight_update`, and `POST /continue_generation`
in a `finally`. `flush_cache` stays false: the launcher disables the radix cache, and a flush
with requests paused in place fails the update (weight_updater.py:120-133).
An update that fails once buckets went out labels the weights `stream-rl-incomplete` too; the
resume still runs. Timings: `receive_ms` = the buckets, `stall_ms` = pause to continue.

Drop and close: `POST /destroy_weights_update_group {"group_name"}` and the local group destroyed;
after a failed update (a collective may still be pending) both happen on a background thread.
A trainer killed mid-broadcast leaves the server's receive waiting for torch's default 30-minute
timeout (SGLang takes none per request): the server cannot answer weight calls until then.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import torch
from pydantic import BaseModel, Field, ValidationError

from stream_rl.errors import WeightSyncError
from stream_rl.weights.adapters.base import INCOMPLETE, EngineSender, dtype_name, require_cuda
from stream_rl.weights.adapters.sglang_group import Collectives, TorchCollectives, pack, plan_buckets
from stream_rl.weights.server_client import ServerEndpoint

log = logging.getLogger(__name__)

PAUSE_MODES = {"keep": "in_place", "recompute": "retract", "drain": "retract"}
"""Our pause policy -> SGLang's `/pause_generation` mode (drain first waits for running requests)."""
NO_SESSION = "no weight-update session is open"
_POLL_S = 0.002


class ServerInfo(BaseModel):
    """What we read of `GET /server_info`."""

    tp_size: int = Field(ge=1)
    dp_size: int = 1
    pp_size: int = 1


@dataclass
class _Group:
    server: ServerEndpoint
    name: str
    group: Any


class SGLangWeightSender(EngineSender):
    """Trainer side of SGLang's distributed weight update, one group per SGLang server."""

    engine = "sglang"

    def __init__(
        self,
        servers: Sequence[ServerEndpoint],
        *,
        master_addr: str = "127.0.0.1",
        master_port: int = 0,
        timeout_s: float = 300.0,
        pause: str = "keep",
        collectives: Collectives | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if pause not in PAUSE_MODES:
            raise WeightSyncError(
                f"SGLang pause policy must be one of {', '.join(PAUSE_MODES)}, got {pause!r}"
            )
        if collectives is None:
            require_cuda(self.engine)
            collectives = TorchCollectives("nccl")
        super().__init__(servers, master_addr=master_addr, master_port=master_port, timeout_s=timeout_s)
        if transport is not None:  # tests: a fake SGLang
            self.http.close()
            self.http = httpx.Client(transport=transport, timeout=timeout_s)
        self.pause = pause
        self.collectives = collectives
        self.group_prefix = f"stream-rl-{uuid.uuid4().hex[:12]}"
        self._group_ids = itertools.count(1)
        self._releasers: list[threading.Thread] = []

    # -- joining -----------------------------------------------------------------------------

    def _post(self, server: ServerEndpoint, path: str, body: dict[str, Any]) -> Any:
        """A weight call; SGLang's `{"success": false}` (sent with 200 or 400) raises."""
        answer = self.call(server, "POST", path, json=body)
        if isinstance(answer, dict) and answer.get("success") is False:
            raise WeightSyncError(f"POST {server.base}{path}: SGLang: {answer.get('message')}")
        return answer

    def _server_info(self, server: ServerEndpoint) -> ServerInfo:
        answer = self.call(server, "GET", "/server_info")
        try:
            info = ServerInfo.model_validate(answer)
        except ValidationError as exc:
            raise WeightSyncError(f"{server.base}/server_info: no tp_size in {str(answer)[:200]}") from exc
        if info.dp_size != 1:
            raise WeightSyncError(
                f"{server.base}: SGLang dp_size is {info.dp_size}; its weight updates from a trainer need "
                "dp_size 1: start one server per replica and list each in inference.servers"
            )
        if info.pp_size != 1:
            raise WeightSyncError(
                f"{server.base}: SGLang pp_size is {info.pp_size}; stream-rl's weight updates need pp_size 1"
            )
        return info

    def _mark_incomplete(self, server: ServerEndpoint) -> None:
        """Label the server's weights `INCOMPLETE` (no running request is aborted): tokens sampled
        from half-updated weights are then refused by our clients instead of passing as a version."""
        body = {"new_version": INCOMPLETE, "abort_all_requests": False}
        self._post(server, "/update_weight_version", body)

    def _recover(self, server: ServerEndpoint) -> None:
        try:
            self._post(server, "/end_weight_update", {})
        except WeightSyncError as exc:
            if NO_SESSION not in str(exc):
                raise
        else:
            log.warning(
                "%s: a weight update was left unfinished (a trainer died mid-update?); its weights "
                "are labelled %r until the next update",
                server.url,
                INCOMPLETE,
            )
            self._mark_incomplete(server)
        self._post(server, "/continue_generation", {})

    def _join(self, server: ServerEndpoint, port: int) -> Any:
        world = self._server_info(server).tp_size + 1
        self._recover(server)
        name = f"{self.group_prefix}-{next(self._group_ids)}"
        body = {
            "master_address": self.master_addr,
            "master_port": port,
            "rank_offset": 1,
            "world_size": world,
            "group_name": name,
            "backend": "nccl",
        }
        # The pool is never waited for: a call stuck on a server that did not join must not hold us.
        pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglang-init")
        try:
            request = pool.submit(self._post, server, "/init_weights_update_group", body)
            try:
                group = self.collectives.join(
                    master_addr=self.master_addr,
                    master_port=port,
                    world_size=world,
                    group_name=name,
                    timeout_s=self.timeout_s,
                )
            except (RuntimeError, ValueError) as exc:  # torch's rendezvous and group errors
                failure = request.exception() if request.done() else None
                if failure is not None:
                    raise failure from None  # the server's own answer says more
                raise WeightSyncError(f"{server.base}: joining group {name} failed: {exc}") from exc
            try:
                request.result(timeout=self.timeout_s)
            except (cf.TimeoutError, WeightSyncError) as exc:
                self.collectives.destroy(group)
                raise WeightSyncError(f"{server.base}: group {name}: {exc or 'no answer in time'}") from exc
        finally:
            pool.shutdown(wait=False)
        return _Group(server, name, group)

    # -- updating ----------------------------------------------------------------------------

    def _send(self, handle: _Group, body: dict[str, Any], tensor: torch.Tensor, deadline: float) -> None:
        """One `/update_weights_from_distributed` call while `tensor` is broadcast; fails as soon
        as the server answers an error, or at `deadline`."""
        pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglang-update")
        try:
            request = pool.submit(self._post, handle.server, "/update_weights_from_distributed", body)
            try:
                work = self.collectives.broadcast(handle.group, tensor)
                while not work.is_completed():
                    if request.done() and request.exception() is not None:
                        raise WeightSyncError(f"the server failed the update: {request.exception()}")
                    if time.monotonic() > deadline:
                        raise WeightSyncError(
                            f"the broadcast of group {handle.name} did not complete in time"
                        )
                    time.sleep(_POLL_S)
                work.wait()  # completed: raises if the collective failed
            except RuntimeError as exc:  # torch's collective errors
                raise WeightSyncError(f"the broadcast of group {handle.name} failed: {exc}") from exc
            try:
                request.result(timeout=max(deadline - time.monotonic(), 0.0))
            except cf.TimeoutError:
                raise WeightSyncError(f"no answer to the update of group {handle.name} in time") from None
        finally:
            pool.shutdown(wait=False)

    def _update(
        self,
        server: ServerEndpoint,
        handle: Any,
        version: int,
        named_tensors: Sequence[tuple[str, torch.Tensor]],
        bucket_bytes: int,
    ) -> dict[str, float]:
        deadline = time.monotonic() + self.timeout_s
        buckets = plan_buckets(named_tensors, bucket_bytes)
        mode = PAUSE_MODES[self.pause]
        paused = time.perf_counter()
        sending = done = False
        try:
            if self.pause == "drain":
                self._post(server, "/begin_weight_update", {})  # waits for running requests
                self._post(server, "/pause_generation", {"mode": mode})
            else:
                self._post(server, "/pause_generation", {"mode": mode})
                self._post(server, "/begin_weight_update", {})
            start = time.perf_counter()
            sending = True
            for i, bucket in enumerate(buckets):
                body: dict[str, Any] = {
                    "names": [name for name, _ in bucket],
                    "dtypes": [dtype_name(t) for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket],
                    "group_name": handle.name,
                    "flush_cache": False,
                    "load_format": "flattened_bucket",
                }
                if i == len(buckets) - 1:
                    body["weight_version"] = str(version)
                self._send(handle, body, pack(bucket), deadline)
            receive_ms = (time.perf_counter() - start) * 1000.0
            self._post(server, "/end_weight_update", {})
            done = True
        except WeightSyncError:
            if sending:  # some buckets may be installed: no version describes these weights
                self._best_effort(self._mark_incomplete, server)
            raise
        finally:
            if done:
                self._post(server, "/continue_generation", {})
            else:  # the failure is the news; a resume that fails too only gets logged
                self._best_effort(lambda s: self._post(s, "/continue_generation", {}), server)
        return {"receive_ms": receive_ms, "stall_ms": (time.perf_counter() - paused) * 1000.0}

    def _best_effort(self, call: Any, server: ServerEndpoint) -> None:
        try:
            call(server)
        except WeightSyncError as exc:
            log.warning("%s: %s", server.url, exc)

    # -- releasing ---------------------------------------------------------------------------

    def _destroy(self, handle: _Group) -> None:
        try:
            self._post(handle.server, "/destroy_weights_update_group", {"group_name": handle.name})
        except WeightSyncError as exc:
            log.warning("%s: destroying group %s failed: %s", handle.server.url, handle.name, exc)
        self.collectives.destroy(handle.group)

    def _release(self, handle: Any, *, pending: bool) -> None:
        if not pending:
            self._destroy(handle)
            return
        # A collective may be pending on the group: releasing it may block, so not here.
        self._releasers = [t for t in self._releasers if t.is_alive()]
        releaser = threading.Thread(target=self._destroy, args=(handle,), name="sglang-release", daemon=True)
        releaser.start()
        self._releasers.append(releaser)

    def close(self) -> None:
        for releaser in self._releasers:  # they still need the HTTP client
            releaser.join(timeout=self.timeout_s + 2.0)
        self._releasers = []
        super().close()


__all__ = ["PAUSE_MODES", "SGLangWeightSender"]
