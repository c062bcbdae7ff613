"""`/weights/init_ipc`, `/weights/update_ipc`: weight updates from a trainer on the same GPU (CUDA IPC).

The colocated counterpart of `weights_routes.py` (protocol: `stream_rl.weights.ipc`). Same token,
same validation and the same in-flight swap; no process group: the trainer sends CUDA IPC handles
of its buckets over HTTP and the server copies from its memory.
- `POST /weights/init_ipc` `{device_uuid, torch_version}` -> `{"status": "joined", "device"}`; 409
  when this server is not on CUDA, not on that GPU, or runs another torch.
- `POST /weights/update_ipc` `{version, tensors, bucket_bytes, buckets}` -> `{version, receive_ms,
  stall_ms}`, answered once the bytes are copied out (the trainer may then reuse its buffers) and
  the new weights are in force. 400: tensors that do not match the model, or a malformed handle;
  409: no init_ipc yet; 502: opening or copying failed (the old weights stay; init_ipc again).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import torch
from fastapi import APIRouter, Request

from stream_rl.errors import InferenceError, WeightSyncError
from stream_rl.inference.context import ServerContext, api_error
from stream_rl.inference.parameters import ParamSpec
from stream_rl.inference.protocol import InitIpcRequest, UpdateIpcRequest
from stream_rl.inference.weights_routes import device_info

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/weights")


@router.post("/init_ipc")
async def init_ipc(request: Request) -> dict[str, Any]:
    ctx: ServerContext = request.app.state.ctx
    body = await ctx.admin_body(request, InitIpcRequest)
    here = device_info(ctx.engine.device)
    if here["type"] != "cuda":
        raise api_error(409, f"cuda_ipc needs a server on CUDA; this one runs on {here['device']} (use gloo)")
    if here["uuid"] != body.device_uuid:
        raise api_error(
            409, f"the trainer's GPU {body.device_uuid} is not this server's GPU {here['uuid']} (use nccl)"
        )
    if body.torch_version != torch.__version__:
        raise api_error(
            409,
            f"cuda_ipc needs the same torch on both sides: trainer {body.torch_version}, server {torch.__version__}",
        )
    async with ctx.weights_lock:
        ctx.ipc_peer = body.device_uuid
        if ctx.ipc_stream is None:
            ctx.ipc_stream = torch.cuda.Stream(ctx.engine.device)
    logger.info("weight updates over CUDA IPC from a trainer on %s", body.device_uuid)
    return {"status": "joined", "device": here}


@router.post("/update_ipc")
async def update_ipc(request: Request) -> dict[str, Any]:
    from stream_rl.weights.buckets import TensorMeta
    from stream_rl.weights.ipc import receive_shared

    ctx: ServerContext = request.app.state.ctx
    body = await ctx.admin_body(request, UpdateIpcRequest)
    table = ctx.engine.parameters
    specs = [ParamSpec(t.name, t.dtype, tuple(t.shape)) for t in body.tensors]
    try:
        table.check(specs)
    except WeightSyncError as exc:
        ctx.metrics.updates.labels("rejected").inc()
        raise api_error(400, str(exc)) from exc
    if ctx.ipc_peer is None or ctx.ipc_stream is None:
        raise api_error(409, "no CUDA IPC peer: POST /weights/init_ipc first")
    metas = [TensorMeta(name=s.name, dtype=s.dtype, shape=s.shape) for s in specs]
    handles = [h.model_dump() for h in body.buckets]
    index = device_info(ctx.engine.device)["device"].split(":")[1]
    async with ctx.weights_lock:
        buffers = table.shadow_buffers(specs)

        def into(m: Any) -> Any:
            return buffers[table.canonical(m.name)]

        try:
            receive_ms, ready = await asyncio.to_thread(
                receive_shared,
                metas,
                body.bucket_bytes,
                handles,
                into,
                device_index=int(index),
                stream=ctx.ipc_stream,
                timeout_s=ctx.weights_timeout_s,
            )
        except WeightSyncError as exc:
            ctx.ipc_peer = None
            ctx.metrics.updates.labels("failed").inc()
            raise api_error(
                502, f"receiving version {body.version} over CUDA IPC failed: {exc}", "weight_sync_error"
            ) from exc
        try:
            swap = await asyncio.wrap_future(ctx.engine.swap_weights(body.version, buffers, ready))
        except InferenceError as exc:
            raise api_error(503, f"version {body.version} not installed: {exc}", "server_error") from exc
        table.recycle(swap.replaced)
    ctx.metrics.receive_seconds.observe(receive_ms / 1000)
    ctx.metrics.stall_seconds.observe(swap.stall_ms / 1000)
    ctx.metrics.updates.labels("ok").inc()
    logger.info(
        "weights version %d in force over CUDA IPC (receive %.1f ms, stall %.2f ms)",
        body.version,
        receive_ms,
        swap.stall_ms,
    )
    return {"version": swap.version, "receive_ms": receive_ms, "stall_ms": swap.stall_ms}
