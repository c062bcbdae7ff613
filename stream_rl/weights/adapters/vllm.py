"""vLLM adapter: the trainer's `WeightPusher` over vLLM's own weight-transfer API.

Server (the launcher starts it so; README "Engines"): `VLLM_SERVER_DEV_MODE=1 python -m
vllm.entrypoints.openai.api_server --model DIR --weight-transfer-config '{"backend": B}'
--logprobs-mode processed_logprobs --no-enable-prefix-caching --enable-scale-out --middleware
stream_rl.weights.vllm_guard.guard ...`, with B one of:
- `stream_rl_gloo` (CPU; verified here with vLLM's CPU build): our engine
  (`stream_rl/weights/vllm_engine.py`) receives our bucket stream over gloo.
- `nccl` (GPU; UNVERIFIED: no GPU here): vLLM's own NCCL engine, driven through vLLM's
  trainer-side `NCCLTrainerWeightTransferEngine` (vLLM must be importable by the trainer).

Join (`connect()`), per server:
1. Recover what a dead trainer may have left: `POST /resume` (a pause never resumed) and
   `POST /finish_weight_update` with no body, which closes an update session left open (vLLM
   answers 500 "without a matching start" when there is none; a session whose receive failed
   answers 500 "was not received" once, and the next finish closes it). No label changes.
2. `GET /get_world_size` (W inference workers), then `POST /init_weight_transfer_engine
   {"init_info": {...}}` while this process joins the same group as rank 0 (world W + 1).
   stream_rl_gloo: `{master_address, master_port, rank_offset: 1, world_size, timeout_s}` and the
   group's handshake broadcast (`stream_rl.weights.group`); nccl: vLLM's `NCCLTrainerInitInfo`
   (packed buckets of `bucket_bytes`, fixed at join).

Update (`push()`), per server, one after another:
- stream_rl_gloo: `POST /start_weight_update`; `POST /update_weights {"update_info": {names,
  dtype_names, shapes, bucket_bytes}}` while the buckets are broadcast (the server receives
  into shadow buffers and keeps decoding); then `POST /pause?mode=M&clear_cache=C`,
  `POST /finish_weight_update {"weight_version": "<version>"}` (install + label), and
  `POST /resume` in a `finally`.
- nccl: pause first (vLLM reloads layer by layer between start and finish, so nothing may run in
  between), then vLLM's `send_weights()` (start, update while broadcasting, finish with our
  label), then resume in a `finally`.
- The pause mode follows the run config: `keep` + `clear_cache=false` (the default: running
  requests keep their old-weight KV, PipelineRL's semantics), `keep` + `clear_cache=true`
  (`kv_policy: recompute`: running requests are recomputed with the new weights) or `wait` +
  `clear_cache=false` (`in_flight_updates: false`: running requests finish on the old weights).
- Timings: `receive_ms` = the broadcast, `stall_ms` = pause to resume (no token is sampled then).

Every call carries `Authorization: Bearer <admin token>` when one is set (the guard checks it).
The label of every update is the trainer's version number, so `weight_versions` in vLLM's
responses are our version spans (`stream_rl/inference/vllm_client.py`).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from stream_rl.errors import WeightSyncError
from stream_rl.weights.adapters.base import EngineSender, dtype_name
from stream_rl.weights.broadcast import send_buckets
from stream_rl.weights.buckets import TensorMeta, plan_buckets
from stream_rl.weights.client import ServerEndpoint
from stream_rl.weights.group import SyncGroup, host_store

BACKENDS = ("stream_rl_gloo", "nccl")
PAUSE_MODES = {"keep": ("keep", False), "recompute": ("keep", True), "drain": ("wait", False)}
"""Our name -> vLLM's `/pause` mode and `clear_cache`."""


class VLLMWeightSender(EngineSender):
    """Trainer side of vLLM's weight transfer, one group per vLLM server."""

    engine = "vllm"

    def __init__(
        self,
        servers: Sequence[ServerEndpoint],
        *,
        backend: str = "stream_rl_gloo",
        master_addr: str = "127.0.0.1",
        master_port: int = 0,
        timeout_s: float = 300.0,
        pause: str = "keep",
        bucket_bytes: int = 16 << 20,
    ) -> None:
        if backend not in BACKENDS:
            raise WeightSyncError(
                f"vLLM weight transfer backend must be one of {', '.join(BACKENDS)}, got {backend!r}"
            )
        if pause not in PAUSE_MODES:
            raise WeightSyncError(f"pause must be one of {', '.join(PAUSE_MODES)}, got {pause!r}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise WeightSyncError(
                "the nccl weight transfer needs CUDA on the trainer; use stream_rl_gloo on CPU"
            )
        super().__init__(servers, master_addr=master_addr, master_port=master_port, timeout_s=timeout_s)
        self.backend = backend
        self.pause_mode, self.clear_cache = PAUSE_MODES[pause]
        self.bucket_bytes = bucket_bytes
        self._releasers: list[threading.Thread] = []

    # -- joining -----------------------------------------------------------------------------

    def _recover(self, server: ServerEndpoint) -> None:
        """Undo what a dead trainer left: a pause, an open update session (a finish closes it;
        a session whose receive failed answers that failure once, the next finish closes it)."""
        self.call(server, "POST", "/resume")
        for _ in range(2):
            try:
                self.call(server, "POST", "/finish_weight_update")
            except WeightSyncError as exc:
                if "without a matching start" in str(exc):
                    return  # no session open
                if "was not received" in str(exc):
                    continue  # the failure of a dead trainer's update: closed by the next finish
                raise
            return

    def _join(self, server: ServerEndpoint, port: int) -> Any:
        self._recover(server)
        workers = int(self.call(server, "GET", "/get_world_size")["world_size"])
        world = workers + 1
        if self.backend == "nccl":
            return _NCCLLink.join(self, server, port, world)
        store = host_store(self.master_addr, port, world, self.timeout_s)
        init_info = {
            "master_address": self.master_addr,
            "master_port": store.port,
            "rank_offset": 1,
            "world_size": world,
            "timeout_s": self.timeout_s,
        }
        with cf.ThreadPoolExecutor(max_workers=1) as pool:
            request = pool.submit(
                self.call, server, "POST", "/init_weight_transfer_engine", json={"init_info": init_info}
            )
            try:
                group = SyncGroup(
                    store,
                    rank=0,
                    world_size=world,
                    backend="gloo",
                    timeout_s=self.timeout_s,
                    local_addr=self.master_addr,
                )
            except WeightSyncError:
                failure = request.exception() if request.done() else None
                if failure is not None:
                    raise failure from None  # the server's own answer says more
                raise
            request.result(timeout=self.timeout_s)
        return group

    def _release(self, handle: Any, *, pending: bool) -> None:
        if not isinstance(handle, SyncGroup):
            handle.shutdown()
        elif pending:
            # A gloo group with a collective pending blocks its release until that times out.
            self._releasers = [t for t in self._releasers if t.is_alive()]
            releaser = threading.Thread(target=handle.close, name="vllm-weights-release", daemon=True)
            releaser.start()
            self._releasers.append(releaser)
        else:
            handle.close()

    def close(self) -> None:
        super().close()
        # A process exiting while a group is torn down aborts: let the releases finish.
        for releaser in self._releasers:
            releaser.join(timeout=self.timeout_s + 2.0)
        self._releasers = []

    # -- updating ----------------------------------------------------------------------------

    def _pause(self, server: ServerEndpoint) -> None:
        params = {"mode": self.pause_mode, "clear_cache": str(self.clear_cache).lower()}
        self.call(server, "POST", "/pause", params=params)

    def _update(
        self,
        server: ServerEndpoint,
        handle: Any,
        version: int,
        named_tensors: Sequence[tuple[str, torch.Tensor]],
        bucket_bytes: int,
    ) -> dict[str, float]:
        if self.backend == "nccl":
            timings: dict[str, float] = handle.update(version, named_tensors)
            return timings
        metas = [TensorMeta.from_tensor(name, tensor) for name, tensor in named_tensors]
        update_info = {
            "names": [m.name for m in metas],
            "dtype_names": [m.dtype for m in metas],
            "shapes": [list(m.shape) for m in metas],
            "bucket_bytes": bucket_bytes,
        }
        self.call(server, "POST", "/start_weight_update")
        start = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        with cf.ThreadPoolExecutor(max_workers=1) as pool:
            request = pool.submit(
                self.call, server, "POST", "/update_weights", json={"update_info": update_info}
            )
            wake = threading.Event()
            request.add_done_callback(lambda _f: wake.set())
            send_buckets(
                handle,
                plan_buckets(metas, bucket_bytes),
                [tensor.detach() for _, tensor in named_tensors],
                deadline=deadline,
                abort=lambda: _failure(request),
                wake=wake,
            )
            request.result(timeout=max(deadline - time.monotonic(), 0.0))
        receive_ms = (time.perf_counter() - start) * 1000.0
        paused = time.perf_counter()
        self._pause(server)
        try:
            self.call(server, "POST", "/finish_weight_update", json={"weight_version": str(version)})
        finally:
            self.call(server, "POST", "/resume")
        return {"receive_ms": receive_ms, "stall_ms": (time.perf_counter() - paused) * 1000.0}


def _failure(request: cf.Future[Any]) -> str | None:
    if request.done() and request.exception() is not None:
        return f"/update_weights failed: {request.exception()}"
    return None


class _Tensors:
    """A vLLM `WeightSource` over the tensors of the current push (set before each send)."""

    def __init__(self) -> None:
        self.tensors: Sequence[tuple[str, torch.Tensor]] = ()

    def metadata(self) -> list[Any]:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.tensors]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return ((name, t.detach()) for name, t in self.tensors)


class _NCCLLink:
    """One server driven through vLLM's trainer-side NCCL engine (GPU; UNVERIFIED here).

    vLLM's `send_weights()` calls the client's start, update (while it broadcasts) and finish;
    the client below adds our pause before start, our label at finish and the resume after.
    """

    def __init__(self, sender: VLLMWeightSender, server: ServerEndpoint) -> None:
        self.sender = sender
        self.server = server
        self.source = _Tensors()
        self.version = 0
        self.engine: Any = None

    @classmethod
    def join(cls, sender: VLLMWeightSender, server: ServerEndpoint, port: int, world: int) -> _NCCLLink:
        from vllm.distributed.weight_transfer.base import WeightSource
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        link = cls(sender, server)
        source = type("StreamRLSource", (_Tensors, WeightSource), {})()
        link.source = source
        info = NCCLTrainerInitInfo(
            master_address=sender.master_addr,
            master_port=port,
            world_size=world,
            packed=True,
            packed_buffer_size_bytes=sender.bucket_bytes,
            rank=0,
        )
        link.engine = WeightTransferTrainerFactory.trainer_init(info, client=link, source=source)
        return link

    # vLLM's VLLMWeightSyncClient protocol, over our HTTP calls
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.sender.call(self.server, "POST", "/init_weight_transfer_engine", json={"init_info": init_info})

    def start_weight_update(self) -> None:
        self.sender.call(self.server, "POST", "/start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self.sender.call(self.server, "POST", "/update_weights", json={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = {"weight_version": weight_version or str(self.version)}
        self.sender.call(self.server, "POST", "/finish_weight_update", json=body)

    def update(self, version: int, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> dict[str, float]:
        self.version = version
        self.source.tensors = named_tensors
        paused = time.perf_counter()
        self.sender._pause(self.server)
        try:
            start = time.perf_counter()
            self.engine.send_weights()
            receive_ms = (time.perf_counter() - start) * 1000.0
        finally:
            self.sender.call(self.server, "POST", "/resume")
        return {"receive_ms": receive_ms, "stall_ms": (time.perf_counter() - paused) * 1000.0}

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


__all__ = ["BACKENDS", "PAUSE_MODES", "VLLMWeightSender", "dtype_name"]
