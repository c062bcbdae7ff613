"""SGLang adapter: the `WeightSender` interface over SGLang's distributed weight-update API.

UNVERIFIED: written to SGLang's documented HTTP API (`/init_weights_update_group`,
`/update_weights_from_distributed`, `/pause_generation`, `/continue_generation`), never run here
(no GPU, no SGLang on the development machine). Needs CUDA and sglang; imported lazily.

- Join: `GET /get_server_info` (`tp_size` workers), then `POST /init_weights_update_group`
  `{master_address, master_port, rank_offset: 1, world_size: tp + 1, group_name, backend: "nccl"}`
  while `init_custom_process_group` (SGLang's own helper, the mechanism the server uses, so the
  two sides rendezvous alike) forms the group here as rank 0.
- Update: `POST /pause_generation {"mode": "in_place"}` (running requests keep their KV cache;
  `pause_mode=None` skips it), then `POST /update_weights_from_distributed` `{names, dtypes,
  shapes, group_name, flush_cache: false, weight_version}` while every tensor is broadcast from
  rank 0 in the listed order (SGLang receives one collective per tensor: no buckets), then
  `POST /continue_generation`.
- Timings: `receive_ms` is the update call, `stall_ms` pause to continue.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Sequence
from typing import Any

import torch

from stream_rl.errors import WeightSyncError
from stream_rl.weights.adapters.base import EngineSender, dtype_name, require_cuda
from stream_rl.weights.client import ServerEndpoint


def _init_custom_process_group() -> Any:
    try:
        from sglang.srt.utils import init_custom_process_group
    except ImportError:  # moved in later releases
        from sglang.srt.utils.common import init_custom_process_group
    return init_custom_process_group


class SGLangWeightSender(EngineSender):
    """Trainer side of SGLang's NCCL weight update, one group per SGLang server."""

    engine = "sglang"

    def __init__(
        self,
        servers: Sequence[ServerEndpoint],
        *,
        master_addr: str = "127.0.0.1",
        master_port: int = 0,
        timeout_s: float = 300.0,
        pause_mode: str | None = "in_place",
    ) -> None:
        require_cuda(self.engine)
        super().__init__(servers, master_addr=master_addr, master_port=master_port, timeout_s=timeout_s)
        self.pause_mode = pause_mode
        self._groups = 0

    def _join(self, server: ServerEndpoint, port: int) -> Any:
        info = self.call(server, "GET", "/get_server_info") or {}
        world_size = int(info.get("tp_size", 1)) + 1
        self._groups += 1
        group_name = f"stream-rl-weights-{self._groups}"
        body = {
            "master_address": self.master_addr,
            "master_port": port,
            "rank_offset": 1,
            "world_size": world_size,
            "group_name": group_name,
            "backend": "nccl",
        }
        with cf.ThreadPoolExecutor(max_workers=1) as pool:
            request = pool.submit(self.call, server, "POST", "/init_weights_update_group", json=body)
            group = _init_custom_process_group()(
                backend="nccl",
                init_method=f"tcp://{self.master_addr}:{port}",
                world_size=world_size,
                rank=0,
                group_name=group_name,
            )
            _check_success(request.result(timeout=self.timeout_s), "/init_weights_update_group")
        return (group, group_name)

    def _update(
        self,
        server: ServerEndpoint,
        handle: Any,
        version: int,
        named_tensors: Sequence[tuple[str, torch.Tensor]],
        bucket_bytes: int,
    ) -> dict[str, float]:
        group, group_name = handle
        body = {
            "names": [name for name, _ in named_tensors],
            "dtypes": [dtype_name(t) for _, t in named_tensors],
            "shapes": [list(t.shape) for _, t in named_tensors],
            "group_name": group_name,
            "flush_cache": False,
            "weight_version": str(version),
        }
        paused = time.perf_counter()
        if self.pause_mode is not None:
            self.call(server, "POST", "/pause_generation", json={"mode": self.pause_mode})
        try:
            start = time.perf_counter()
            with cf.ThreadPoolExecutor(max_workers=1) as pool:
                request = pool.submit(
                    self.call, server, "POST", "/update_weights_from_distributed", json=body
                )
                for _, tensor in named_tensors:
                    torch.distributed.broadcast(tensor.detach().contiguous(), src=0, group=group)
                _check_success(request.result(timeout=self.timeout_s), "/update_weights_from_distributed")
            receive_ms = (time.perf_counter() - start) * 1000.0
        finally:
            if self.pause_mode is not None:
                self.call(server, "POST", "/continue_generation", json={})
        return {"receive_ms": receive_ms, "stall_ms": (time.perf_counter() - paused) * 1000.0}


def _check_success(answer: Any, path: str) -> None:
    if isinstance(answer, dict) and answer.get("success") is False:
        raise WeightSyncError(f"SGLang {path} failed: {answer.get('message')}")
