"""`/weights/*`: join the trainer's weight-sync group and install broadcast weights in flight.

All routes require `Authorization: Bearer <admin token>` when the server has one (else 401).
- `GET /weights/device` -> `{"device", "type", "uuid"}`: where the weights live (the GPU's uuid).
- `GET /weights/version` -> `{"version"}`; `GET /weights/meta` -> `[{"name", "dtype", "shape"}]`,
  the model's parameters (tied ones once) in `named_parameters()` order: what an update may send.
- `POST /weights/init_group` `{master_addr, master_port, rank, world_size, backend}`: joins the
  dedicated group whose rank 0 (the trainer) hosts the store; answers once joined. Joining
  again replaces the previous membership (a restarted trainer re-joins).
- `POST /weights/update` `{version, tensors: [{name, dtype, shape}], bucket_bytes}`: receives
  the buckets (layout: `stream_rl.weights.buckets`) into shadow buffers while decoding goes on,
  then the engine swaps them in between two decode steps; answers `{version, receive_ms,
  stall_ms}` once the new weights are in force. Updates are serialised.

Errors: a body that does not validate, or tensors that do not match the model (unknown name,
wrong shape or dtype, a tied parameter twice) -> 400, checked before anything is received;
note that the sender has broadcast regardless, so it should check `GET /weights/meta` first.
No group yet -> 409. The group failing (unreachable store, timeout, a peer gone) -> 502, the
old weights stay in force and the membership is dropped (the trainer must init_group again).
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
from stream_rl.inference.protocol import InitGroupRequest, UpdateWeightsRequest
from stream_rl.weights.group import gpu_uuid

logger = logging.getLogger(__name__)


def device_info(dev: torch.device) -> dict[str, Any]:
    if dev.type != "cuda":
        return {"device": str(dev), "type": dev.type, "uuid": None}
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return {"device": f"cuda:{index}", "type": "cuda", "uuid": gpu_uuid(index)}


router = APIRouter(prefix="/weights")


def _ctx(request: Request) -> ServerContext:
    ctx: ServerContext = request.app.state.ctx
    ctx.check_admin(request)
    return ctx


@router.get("/version")
async def version(request: Request) -> dict[str, int]:
    return {"version": _ctx(request).engine.version}


@router.get("/device")
async def device(request: Request) -> dict[str, Any]:
    """Where the weights live: `{"device", "type", "uuid"}` (uuid: the GPU's, None on CPU). The
    trainer's `weight_transport: auto` picks cuda_ipc for a server on its own GPU."""
    return device_info(_ctx(request).engine.device)


@router.get("/meta")
async def meta(request: Request) -> list[dict[str, Any]]:
    specs = _ctx(request).engine.parameters.specs()
    return [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape)} for s in specs]


# The bodies are parsed after the token check (a FastAPI body parameter would be validated
# first, answering 400 to an unauthenticated caller).
@router.post("/init_group")
async def init_group(request: Request) -> dict[str, Any]:
    ctx: ServerContext = request.app.state.ctx
    body = await ctx.admin_body(request, InitGroupRequest)
    if body.rank >= body.world_size:
        raise api_error(400, f"rank {body.rank} is outside a group of {body.world_size}")
    async with ctx.weights_lock:
        old, ctx.receiver = ctx.receiver, None
        if old is not None:
            await asyncio.to_thread(old.close)
        try:
            ctx.receiver = await asyncio.to_thread(
                ctx.receiver_factory,
                master_addr=body.master_addr,
                master_port=body.master_port,
                rank=body.rank,
                world_size=body.world_size,
                backend=body.backend,
                timeout_s=body.timeout_s or ctx.weights_timeout_s,
                device=str(ctx.engine.device),
            )
        except WeightSyncError as exc:
            raise api_error(502, f"could not join the weight-sync group: {exc}", "weight_sync_error") from exc
    logger.info(
        "joined weight-sync group %s:%d as rank %d/%d (%s)",
        body.master_addr,
        body.master_port,
        body.rank,
        body.world_size,
        body.backend,
    )
    return {"status": "joined", "rank": body.rank, "world_size": body.world_size, "backend": body.backend}


@router.post("/update")
async def update(request: Request) -> dict[str, Any]:
    ctx: ServerContext = request.app.state.ctx
    body = await ctx.admin_body(request, UpdateWeightsRequest)
    table = ctx.engine.parameters
    specs = [ParamSpec(t.name, t.dtype, tuple(t.shape)) for t in body.tensors]
    try:
        table.check(specs)
    except WeightSyncError as exc:
        ctx.metrics.updates.labels("rejected").inc()
        raise api_error(400, str(exc)) from exc
    if ctx.receiver is None:
        raise api_error(409, "no weight-sync group: POST /weights/init_group first")
    from stream_rl.weights.buckets import TensorMeta  # the weights package owns the wire layout

    metas = [TensorMeta(name=s.name, dtype=s.dtype, shape=s.shape) for s in specs]
    async with ctx.weights_lock:
        receiver = ctx.receiver
        if receiver is None:  # the group failed while this update waited for the previous one
            raise api_error(409, "no weight-sync group: POST /weights/init_group first")
        buffers = table.shadow_buffers(specs)

        def into(m: Any) -> Any:
            return buffers[table.canonical(m.name)]

        try:
            receive_ms = await asyncio.to_thread(receiver.receive, metas, body.bucket_bytes, into)
        except WeightSyncError as exc:
            if ctx.engine.device.type != "cuda":
                # CUDA: an aborted collective may still write into these; let them go instead
                # (the allocator holds them until the streams that used them are done).
                table.recycle(buffers)
            ctx.receiver = None
            await asyncio.to_thread(receiver.close)
            ctx.metrics.updates.labels("failed").inc()
            raise api_error(
                502, f"receiving version {body.version} failed: {exc}", "weight_sync_error"
            ) from exc
        try:
            swap = await asyncio.wrap_future(ctx.engine.swap_weights(body.version, buffers, receiver.ready))
        except InferenceError as exc:  # the engine is not running
            raise api_error(503, f"version {body.version} not installed: {exc}", "server_error") from exc
        table.recycle(swap.replaced)
    ctx.metrics.receive_seconds.observe(receive_ms / 1000)
    ctx.metrics.stall_seconds.observe(swap.stall_ms / 1000)
    ctx.metrics.updates.labels("ok").inc()
    logger.info(
        "weights version %d in force (receive %.1f ms, stall %.2f ms)",
        body.version,
        receive_ms,
        swap.stall_ms,
    )
    return {"version": swap.version, "receive_ms": receive_ms, "stall_ms": swap.stall_ms}
