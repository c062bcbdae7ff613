"""vLLM adapter: the trainer's `WeightPusher` over vLLM's own weight-transfer API.

Server (the launcher starts it so; docs/engines.md "Engines"): `VLLM_SERVER_DEV_MODE=1 python -m
vllm.entrypoints.openai.api_server --model DIR --weight-transfer-config '{"backend": B}'
--logprobs-mode processed_logprobs --no-enable-prefix-caching --enable-scale-out --middleware
stream_rl.weights.vllm_guard.guard ...`, with B one of:
- `stream_rl_gloo` (CPU; verified here with vLLM's CPU build): our engine
  (`stream_rl/weights/vllm_engine.py`) receives our bucket stream over gloo.
- `nccl` (GPU; UNVERIFIED: no GPU here): vLLM's own NCCL engine, driven through vLLM 0.33's
  trainer-side `NCCLTrainerWeightTransferEngine` (vLLM 0.33 must be importable by the trainer;
  0.32's trainer engine had another `WeightSource` interface and is refused at join).

Join (`connect()`), per server:
1. Recover what a dead trainer may have left, the session before the pause (`recover_session`):
   - stream_rl_gloo (installs nothing before finish): `POST /update_weights {"update_info":
     {"discard": true}}`; the engine drops what the session received and vLLM answers 500 "the
     unfinished weight update was discarded; the old weights stay" (session ended), or 500
     "start_weight_update must be called before update_weights." (none open). The label stays true.
   - nccl (reloads layer by layer from start on): `POST /finish_weight_update {"weight_version":
     "stream-rl-incomplete"}`; vLLM answers 500 "without a matching start" when no session is open
     (nothing changes), else the weights are labelled `stream-rl-incomplete`, which our clients
     refuse, until this trainer's first push.
   Only then `POST /resume` (a pause never resumed): decoding never restarts on weights whose
   label lies. (The server's guard does the same when a pause lease expires: `vllm_guard.py`.)
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
  label); if it fails after start, the session is finished under `stream-rl-incomplete` before
  the resume in the `finally`.
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
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from functools import cached_property
from typing import Any

import torch

from stream_rl.errors import WeightSyncError
from stream_rl.weights.adapters.base import INCOMPLETE, EngineSender, dtype_name
from stream_rl.weights.broadcast import send_buckets
from stream_rl.weights.buckets import TensorMeta, plan_buckets
from stream_rl.weights.group import SyncGroup, host_store
from stream_rl.weights.server_client import ServerEndpoint
from stream_rl.weights.vllm_guard import DISCARDED, GLOO_BACKEND

log = logging.getLogger(__name__)

BACKENDS = (GLOO_BACKEND, "nccl")
NCCL_VLLM = "0.33"
"""The vLLM release whose trainer-side NCCL engine `_NCCLLink` follows (read from its wheel)."""
NO_SESSION = "without a matching start"
"""vLLM's answer to a finish when no update session is open."""
NO_UPDATE = "must be called before update_weights"
"""vLLM's answer to an update when no update session is open."""
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
        """Undo what a dead trainer left, in this order: its update session closed (labelled
        `INCOMPLETE` if it may have installed anything), then its pause lifted (module docstring)."""
        if self.recover_session(server):
            log.warning(
                "%s: a weight update was left unfinished (a trainer died mid-update?); its weights "
                "are labelled %r until this trainer's first push",
                server.url,
                INCOMPLETE,
            )
        self.call(server, "POST", "/resume")

    def recover_session(self, server: ServerEndpoint) -> bool:
        """Close an update session left open; True if it may have installed weights (then labelled
        `INCOMPLETE`). The server stays paused if it was.

        stream_rl_gloo installs nothing before finish: the session is discarded (`update_info`
        `{"discard": true}`), nothing installed, the label kept. nccl reloads layer by layer from
        start on: the session is finished under `INCOMPLETE`."""
        if self.backend == GLOO_BACKEND:
            try:
                self.call(server, "POST", "/update_weights", json={"update_info": {"discard": True}})
            except WeightSyncError as exc:
                if DISCARDED in str(exc) or NO_UPDATE in str(exc):
                    return False
                raise
            raise WeightSyncError(
                f"{server.url}: a discarding update was accepted: the server does not run the "
                "stream_rl_gloo engine (start it with --weight-transfer-config "
                '\'{"backend": "stream_rl_gloo"}\')'
            )
        try:
            self.call(server, "POST", "/finish_weight_update", json={"weight_version": INCOMPLETE})
        except WeightSyncError as exc:
            if NO_SESSION in str(exc):
                return False
            raise
        return True

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

    def _nccl_engine(self, info: Any, link: _NCCLLink) -> Any:
        """vLLM's trainer engine for one server (its factory dispatches on `info.backend`)."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        return WeightTransferTrainerFactory.trainer_init(info, client=link, source=link.source)

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
        receive_ms = self.send(server, handle, named_tensors, bucket_bytes)
        paused = time.perf_counter()
        self._pause(server)
        try:
            self.call(server, "POST", "/finish_weight_update", json={"weight_version": str(version)})
        finally:
            self.call(server, "POST", "/resume")
        return {"receive_ms": receive_ms, "stall_ms": (time.perf_counter() - paused) * 1000.0}

    def send(
        self,
        server: ServerEndpoint,
        group: SyncGroup,
        named_tensors: Sequence[tuple[str, torch.Tensor]],
        bucket_bytes: int,
    ) -> float:
        """stream_rl_gloo's first half of an update: the session started, every bucket broadcast
        and received into the server's shadow buffers (nothing installed); its time in ms."""
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
                group,
                plan_buckets(metas, bucket_bytes),
                [tensor.detach() for _, tensor in named_tensors],
                deadline=deadline,
                abort=lambda: _failure(request),
                wake=wake,
            )
            request.result(timeout=max(deadline - time.monotonic(), 0.0))
        return (time.perf_counter() - start) * 1000.0


def _failure(request: cf.Future[Any]) -> str | None:
    if request.done() and request.exception() is not None:
        return f"/update_weights failed: {request.exception()}"
    return None


class _Tensors:
    """The tensors of the current push as vLLM 0.33's `WeightSource` (made a subclass of it by
    `weight_source()`): `metadata` a `cached_property` (vLLM's base class insists, and engines read
    it repeatedly), `iter_full()` the full tensors in that order. `set()` swaps in each push's
    tensors and drops the cached metadata (unchanged names, dtypes and shapes make vLLM send the
    metadata once: it compares it with the last round's)."""

    def __init__(self) -> None:
        self.tensors: Sequence[tuple[str, torch.Tensor]] = ()

    def set(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.tensors = tensors
        self.__dict__.pop("metadata", None)

    @cached_property
    def metadata(self) -> list[Any]:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.tensors]

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        return ((name, t.detach()) for name, t in self.tensors)


def weight_source() -> _Tensors:
    """A `_Tensors` that is a vLLM `WeightSource` (vLLM imported here: the trainer's environment)."""
    from vllm.distributed.weight_transfer.base import WeightSource

    source: _Tensors = type("StreamRLSource", (_Tensors, WeightSource), {})()
    return source


def vllm_version() -> str:
    """The vLLM release importable by this process; WeightSyncError if none, or not `NCCL_VLLM`."""
    try:
        import vllm
    except ImportError as exc:
        raise WeightSyncError(
            f"vLLM nccl weight transfer: the trainer drives vLLM's own NCCL engine, but vLLM is not "
            f"importable here ({exc}); install vllm=={NCCL_VLLM}.0 in the trainer's environment"
        ) from exc
    version = str(vllm.__version__)
    if not version.startswith(NCCL_VLLM):
        raise WeightSyncError(
            f"vLLM {version} nccl weight transfer: stream-rl follows vLLM {NCCL_VLLM}'s trainer engine "
            f"(its WeightSource interface changed in {NCCL_VLLM}); install vllm=={NCCL_VLLM}.0"
        )
    return version


def nccl_init_info(sender: VLLMWeightSender, port: int, world: int) -> Any:
    """vLLM's `NCCLTrainerInitInfo` of one server's group: this process rank 0 of `world`, packed
    buckets of the sender's `bucket_bytes` (fixed at join: vLLM sends them to the server then)."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    return NCCLTrainerInitInfo(
        master_address=sender.master_addr,
        master_port=port,
        world_size=world,
        packed=True,
        packed_buffer_size_bytes=sender.bucket_bytes,
        rank=0,
    )


ENGINE_ERRORS = (TypeError, ValueError, RuntimeError, OSError, AssertionError)
"""What vLLM's trainer engine raises when the two sides disagree or NCCL fails (its own checks
raise TypeError and ValueError; NCCL and torch.distributed raise RuntimeError and OSError)."""


class _NCCLLink:
    """One server driven through vLLM 0.33's trainer-side NCCL engine (GPU; UNVERIFIED here).

    vLLM's `send_weights()` calls the client's start, update (while it broadcasts) and finish;
    the client below adds our pause before start, our label at finish and the resume after. Any
    error of vLLM's engine is one `WeightSyncError` line naming vLLM, its version and the step.
    """

    def __init__(self, sender: VLLMWeightSender, server: ServerEndpoint, version: str) -> None:
        self.sender = sender
        self.server = server
        self.vllm = version
        self.source = weight_source()
        self.version = 0
        self.engine: Any = None

    @classmethod
    def join(cls, sender: VLLMWeightSender, server: ServerEndpoint, port: int, world: int) -> _NCCLLink:
        link = cls(sender, server, vllm_version())
        info = nccl_init_info(sender, port, world)
        try:
            link.engine = sender._nccl_engine(info, link)
        except ENGINE_ERRORS as exc:
            raise link.failure("joining", exc) from exc
        return link

    def failure(self, step: str, exc: BaseException) -> WeightSyncError:
        return WeightSyncError(
            f"vLLM {self.vllm} nccl weight transfer: {step} {self.server.url} failed: "
            f"{type(exc).__name__}: {exc}"
        )

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
        self.source.set(named_tensors)
        paused = time.perf_counter()
        self.sender._pause(self.server)
        try:
            start = time.perf_counter()
            try:
                self.engine.send_weights()
            except (WeightSyncError, *ENGINE_ERRORS) as exc:
                # Layers may be reloaded already: no version describes the weights. Close the
                # session under the label our clients refuse before decoding resumes (vLLM ends
                # it itself when update_weights fails: then only the label is set).
                try:
                    if not self.sender.recover_session(self.server):
                        body = {"new_version": INCOMPLETE}
                        self.sender.call(self.server, "POST", "/update_weight_version", json=body)
                except WeightSyncError as closing:
                    log.warning("%s: the failed update's session not closed: %s", self.server.url, closing)
                if isinstance(exc, WeightSyncError):
                    raise
                raise self.failure("updating", exc) from exc
            receive_ms = (time.perf_counter() - start) * 1000.0
        finally:
            self.sender.call(self.server, "POST", "/resume")
        return {"receive_ms": receive_ms, "stall_ms": (time.perf_counter() - paused) * 1000.0}

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


__all__ = ["BACKENDS", "INCOMPLETE", "PAUSE_MODES", "VLLMWeightSender", "dtype_name"]
