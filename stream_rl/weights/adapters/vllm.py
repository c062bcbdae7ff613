"""vLLM adapter: the `WeightSender` interface over vLLM's native weight-transfer API.

UNVERIFIED: written to vLLM's documented API (docs.vllm.ai, "Weight Transfer", and the
`examples/rl/rlhf_http_nccl.py` example), never run here (no GPU, no vLLM on the development
machine). Needs CUDA on the trainer and `pip install '.[gpu]'`; vllm is imported lazily.

Server: `VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "nccl"}'`.
- Join: `GET /get_world_size` (the server's W workers), then `POST /init_weight_transfer_engine`
  `{"init_info": {master_address, master_port, rank_offset: 1, world_size: W + 1}}` while
  `NCCLWeightTransferEngine.trainer_init` forms the group here as rank 0.
- Update: `POST /pause?mode=keep` (running requests frozen with their KV cache, PipelineRL's
  in-flight semantics; `pause_mode=None` skips pausing), `POST /start_weight_update`
  `{"is_checkpoint_format": true}`, then `POST /update_weights` `{"update_info": {names,
  dtype_names, shapes, packed, packed_buffer_size_bytes}}` while `trainer_send_weights`
  broadcasts (packed: flat buffers of `bucket_bytes`, like ours), `POST /finish_weight_update`,
  `POST /resume`. Versions without the start/finish phases (404) skip them.
- Timings: `receive_ms` is the `/update_weights` call, `stall_ms` pause to resume (vLLM installs
  the weights while paused, so decoding stalls for the whole transfer, unlike our server).
Tensor names are the Hugging Face checkpoint names (`named_parameters()` of the trainer's
model); vLLM maps them onto its fused layers itself.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Sequence
from typing import Any

import torch

from stream_rl.weights.adapters.base import EngineSender, dtype_name, require_cuda
from stream_rl.weights.client import ServerEndpoint


class VLLMWeightSender(EngineSender):
    """Trainer side of vLLM's native NCCL weight transfer, one group per vLLM server."""

    engine = "vllm"

    def __init__(
        self,
        servers: Sequence[ServerEndpoint],
        *,
        master_addr: str = "127.0.0.1",
        master_port: int = 0,
        timeout_s: float = 300.0,
        pause_mode: str | None = "keep",
        packed: bool = True,
    ) -> None:
        require_cuda(self.engine)
        super().__init__(servers, master_addr=master_addr, master_port=master_port, timeout_s=timeout_s)
        self.pause_mode = pause_mode
        self.packed = packed

    def _join(self, server: ServerEndpoint, port: int) -> Any:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        workers = int(self.call(server, "GET", "/get_world_size")["world_size"])
        init_info = {
            "master_address": self.master_addr,
            "master_port": port,
            "rank_offset": 1,
            "world_size": workers + 1,
        }
        with cf.ThreadPoolExecutor(max_workers=1) as pool:
            request = pool.submit(
                self.call, server, "POST", "/init_weight_transfer_engine", json={"init_info": init_info}
            )
            group = NCCLWeightTransferEngine.trainer_init(
                {"master_address": self.master_addr, "master_port": port, "world_size": workers + 1}
            )
            request.result(timeout=self.timeout_s)
        return group

    def _update(
        self,
        server: ServerEndpoint,
        handle: Any,
        version: int,
        named_tensors: Sequence[tuple[str, torch.Tensor]],
        bucket_bytes: int,
    ) -> dict[str, float]:
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerSendWeightsArgs,
            NCCLWeightTransferEngine,
        )

        update_info = {
            "names": [name for name, _ in named_tensors],
            "dtype_names": [dtype_name(t) for _, t in named_tensors],
            "shapes": [list(t.shape) for _, t in named_tensors],
            "packed": self.packed,
            "packed_buffer_size_bytes": bucket_bytes,
        }
        paused = time.perf_counter()
        if self.pause_mode is not None:
            self.call(server, "POST", "/pause", params={"mode": self.pause_mode})
        try:
            self.call(
                server, "POST", "/start_weight_update", json={"is_checkpoint_format": True}, missing_ok=True
            )
            start = time.perf_counter()
            with cf.ThreadPoolExecutor(max_workers=1) as pool:
                request = pool.submit(
                    self.call, server, "POST", "/update_weights", json={"update_info": update_info}
                )
                args = NCCLTrainerSendWeightsArgs(
                    group=handle, packed=self.packed, packed_buffer_size_bytes=bucket_bytes
                )
                NCCLWeightTransferEngine.trainer_send_weights(iterator=iter(named_tensors), trainer_args=args)
                request.result(timeout=self.timeout_s)
            receive_ms = (time.perf_counter() - start) * 1000.0
            self.call(server, "POST", "/finish_weight_update", json={}, missing_ok=True)
        finally:
            if self.pause_mode is not None:
                self.call(server, "POST", "/resume")
        return {"receive_ms": receive_ms, "stall_ms": (time.perf_counter() - paused) * 1000.0}
