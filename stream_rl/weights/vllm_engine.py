"""`stream_rl_gloo`: a vLLM weight-transfer engine over gloo, so vLLM on CPU runs vLLM's own weight
update path (`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`) with stream-rl's bucketed broadcast.

This module runs inside the vLLM server (its worker process); it imports vLLM and is loaded by
vLLM's plugin mechanism: stream-rl declares `register` under the `vllm.general_plugins` entry
point (pyproject.toml), so a vLLM environment with stream-rl installed (`make vllm` does it with
`--no-deps`) accepts `--weight-transfer-config '{"backend": "stream_rl_gloo"}'`. Nothing else
of stream-rl is needed there: this module, the receiver and the bucket layout import only torch.

Worker side of the protocol (the trainer side is `stream_rl.weights.adapters.vllm`):
- `init_info` `{master_address, master_port, rank_offset, world_size, timeout_s}`: the worker joins
  the group whose store the trainer (rank 0) hosts, as rank `rank_offset + its worker rank`,
  exactly as `stream_rl.weights.receiver.WeightReceiver` does for the built-in server (one
  handshake broadcast of the marker 0x5354524D from rank 0). A new init replaces any old group.
- `update_info` `{names, dtype_names, shapes, bucket_bytes}`: starts receiving the tensors, in
  that order, packed into buckets of at most `bucket_bytes` (`stream_rl.weights.buckets`), into
  shadow buffers on a background thread, and returns at once: the engine keeps decoding while
  the bytes travel.
- finish: waits for the receive (at most `timeout_s`), then loads every tensor with the model's
  own `load_weights` (Hugging Face names; vLLM fuses q/k/v and gate/up itself). A failed or
  incomplete receive raises and installs nothing: the model keeps its old weights. Nothing is
  installed before finish, so a trainer that dies at any point before it leaves the old weights
  in place (and the label the trainer sets with finish unchanged: labels never lie).
- start: forgets a receive that was never finished.
- `update_info` `{"discard": true}` (a joining trainer's recovery): drops whatever a dead trainer's
  session received and raises `DISCARDED`, so vLLM answers 500 with that message and ends the
  session; nothing is installed and the label stays true. With no session open vLLM answers 500
  "start_weight_update must be called before update_weights." and nothing changes.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
from dataclasses import dataclass
from typing import Any

import torch

from stream_rl.errors import WeightSyncError
from stream_rl.weights.buckets import TensorMeta
from stream_rl.weights.receiver import WeightReceiver
from stream_rl.weights.vllm_guard import DISCARDED, GLOO_BACKEND

log = logging.getLogger("vllm.stream_rl.weights")  # under "vllm": printed by its handler

BACKEND = GLOO_BACKEND
DEFAULT_TIMEOUT_S = 60.0

try:  # only inside a vLLM environment
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
except ImportError:  # pragma: no cover - the module is only imported by vLLM's plugin loader
    WeightTransferEngine = object
    WeightTransferInitInfo = object
    WeightTransferUpdateInfo = object


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    bucket_bytes: int

    def metas(self) -> list[TensorMeta]:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError("names, dtype_names and shapes must have the same length")
        return [
            TensorMeta(name, dtype, tuple(int(d) for d in shape))
            for name, dtype, shape in zip(self.names, self.dtype_names, self.shapes, strict=True)
        ]


class GlooWeightTransferEngine(WeightTransferEngine):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._receiver: WeightReceiver | None = None
        self._timeout_s = DEFAULT_TIMEOUT_S
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="stream-rl-weights")
        self._pending: cf.Future[dict[str, torch.Tensor]] | None = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.shutdown()
        parallel = self.parallel_config
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        self._timeout_s = init_info.timeout_s
        self._receiver = WeightReceiver(
            master_addr=init_info.master_address,
            master_port=init_info.master_port,
            rank=rank,
            world_size=init_info.world_size,
            backend="gloo",
            timeout_s=init_info.timeout_s,
        )
        log.info("stream-rl weight sync: joined as rank %d of %d", rank, init_info.world_size)

    def start_weight_update(self) -> None:
        if self._pending is not None:
            log.warning("stream-rl weight sync: an unfinished update is discarded")
            self._pending = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        if update_info.get("discard") is True:
            # A joining trainer's recovery: what a dead one left is dropped, never installed.
            # Raising ends vLLM's update session (its worker does so when an update fails).
            self._pending = None
            raise RuntimeError(DISCARDED)
        info = self.parse_update_info(update_info)
        info.metas()  # a malformed update fails here, before anything is received
        if self._pending is not None:
            raise RuntimeError("an update is already being received; finish it first")
        self._pending = self._pool.submit(self._receive, info)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        """Receive and install at once (vLLM's synchronous path; the routes use the split one)."""
        self._install(self._receive(update_info))

    def finish_weight_update(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return  # nothing received: finish only closes the worker's update session
        try:
            shadows = pending.result(timeout=self._timeout_s + 5.0)
        except (cf.TimeoutError, WeightSyncError) as exc:
            raise RuntimeError(f"the weight update was not received; the old weights stay: {exc}") from exc
        self._install(shadows)

    def _receive(self, info: GlooUpdateInfo) -> dict[str, torch.Tensor]:
        receiver = self._receiver
        if receiver is None:
            raise WeightSyncError("stream_rl_gloo: no trainer joined (init_weight_transfer_engine first)")
        metas = info.metas()
        shadows = {m.name: torch.empty(m.shape, dtype=m.torch_dtype) for m in metas}
        try:
            receiver.receive(metas, info.bucket_bytes, lambda m: shadows[m.name])
        except WeightSyncError:
            # The two sides no longer agree on the stream: the trainer must join again.
            self._receiver = None
            receiver.close()
            raise
        return shadows

    def _install(self, shadows: dict[str, torch.Tensor]) -> None:
        """vLLM's layerwise reload around the model's `load_weights`, all inside one engine RPC
        (no step runs in between): the layers are rebuilt, loaded and post-processed."""
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        device = self.device
        with torch.no_grad(), disable_mtp_completeness_check():
            initialize_layerwise_reload(self.model)
            self.model.load_weights([(name, t.to(device)) for name, t in shadows.items()])
            finalize_layerwise_reload(self.model, self.model_config)
            _repack_tied_heads(self.model)

    def shutdown(self) -> None:
        self._pending = None
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None


def _repack_tied_heads(model: torch.nn.Module) -> None:
    """vLLM's CPU build multiplies by a packed copy of each embedding/LM-head weight
    (`cpu_linear`, made by `process_weights_after_loading`). A head tied to the input embedding
    loads nothing itself, so the layerwise reload leaves its packed copy stale (the reload's
    documented limitation for tied parameters): the logits would still come from the old
    weights. Re-pack every such head from its (updated) weight. GPU builds have no `cpu_linear`."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear"):
            module.quant_method.process_weights_after_loading(module)


def register() -> None:
    """The `vllm.general_plugins` entry point: make `stream_rl_gloo` a weight-transfer backend."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "GlooWeightTransferEngine")
