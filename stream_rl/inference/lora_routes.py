"""`POST /weights/update_lora`: install a version sent as LoRA adapters (docs/weights-protocol.md).

Body: `{version, tensors, bucket_bytes, scale, base_checksum}`, `tensors` the adapters as
`<weight>.lora_A` [r, in] and `<weight>.lora_B` [out, r] (`stream_rl.weights.lora`), broadcast in
buckets as in `POST /weights/update`. The server keeps a copy of the base value of every weight an
adapter targets (taken at the first LoRA update, while its weights are verified to be the base:
`base_checksum` is `weights_checksum` of every parameter, the targeted ones at their base
value), receives A and B, computes each targeted weight as `merge(W0, A, B, scale)` into shadow
buffers while decoding goes on, and swaps them in between two decode steps like any update.
Weights not targeted are left as they are (the base's). The base is verified again whenever
another route installed a version since the last LoRA update (a full push changes other weights).

Answers `{version, receive_ms, stall_ms, transfer_ms, merge_ms}` (`receive_ms`: transfer + merge,
the time before the swap). Errors as `/weights/update`, plus 409 when the served weights are not
the trainer's base (the adapters are received, so the group stays usable, and not installed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import APIRouter, Request
from pydantic import Field

from stream_rl.errors import InferenceError, WeightSyncError
from stream_rl.inference.context import ServerContext, api_error
from stream_rl.inference.parameters import ParameterTable, ParamSpec
from stream_rl.inference.protocol import UpdateWeightsRequest
from stream_rl.weights.buckets import TensorMeta
from stream_rl.weights.checksum import weights_checksum
from stream_rl.weights.lora import LoraPair, merge, pair_metas

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/weights")


class UpdateLoraRequest(UpdateWeightsRequest):
    scale: float
    """`alpha / r`: the served weight is `W0 + scale * B @ A`."""
    base_checksum: str = Field(min_length=1)
    """`weights_checksum` of the base model every parameter of this server must start from."""


@dataclass
class LoraBase:
    """The base value of every weight an adapter targeted, and what it was verified against."""

    checksum: str
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    version: int | None = None
    """The version the last LoRA update installed (another install since: verify again)."""


def _verify(table: ParameterTable, base: dict[str, torch.Tensor], expected: str) -> bool:
    """Whether the served weights, the targeted ones at their kept base value, are `expected`."""
    named = [(s.name, base.get(s.name, table.get(s.name))) for s in table.specs()]
    return weights_checksum(named) == expected


def _prepare_base(
    ctx: ServerContext, state: LoraBase | None, body: UpdateLoraRequest, names: list[str]
) -> LoraBase:
    """The base copies for `names`, verified (raises `WeightSyncError` if the weights are not the base)."""
    table = ctx.engine.parameters
    if state is None or state.checksum != body.base_checksum:
        state = LoraBase(checksum=body.base_checksum)
        state.version = None
    fresh = [n for n in names if n not in state.tensors]
    stale = state.version is None or state.version != ctx.engine.version
    candidate = dict(state.tensors)
    for name in fresh:  # never touched by a LoRA update: its current value is the base, if verified
        candidate[name] = table.get(name).detach().clone()
    if (stale or fresh) and not _verify(table, candidate, body.base_checksum):
        raise WeightSyncError(
            f"the served weights are not the trainer's base model (checksum {body.base_checksum[:16]}): "
            "start the server from the trainer's model.path, or restart it"
        )
    state.tensors = candidate
    return state


@router.post("/update_lora")
async def update_lora(request: Request) -> dict[str, Any]:
    ctx: ServerContext = request.app.state.ctx
    body = await ctx.admin_body(request, UpdateLoraRequest)
    table = ctx.engine.parameters
    metas = [TensorMeta(name=t.name, dtype=t.dtype, shape=tuple(t.shape)) for t in body.tensors]
    weights = {s.name: TensorMeta(s.name, s.dtype, s.shape) for s in table.specs()}
    try:
        pairs: list[LoraPair] = pair_metas(metas, weights)
    except WeightSyncError as exc:
        ctx.metrics.updates.labels("rejected").inc()
        raise api_error(400, str(exc)) from exc
    if ctx.receiver is None:
        raise api_error(409, "no weight-sync group: POST /weights/init_group first")
    async with ctx.weights_lock:
        receiver = ctx.receiver
        if receiver is None:
            raise api_error(409, "no weight-sync group: POST /weights/init_group first")
        names = [p.name for p in pairs]
        started = time.perf_counter()
        refused: str | None = None
        try:
            previous = getattr(request.app.state, "lora_base", None)
            state = await asyncio.to_thread(_prepare_base, ctx, previous, body, names)
        except WeightSyncError as exc:
            refused = str(exc)
        device = ctx.engine.device
        adapters = {m.name: torch.empty(m.shape, dtype=m.torch_dtype, device=device) for m in metas}
        try:
            # Received even when refused: the trainer broadcasts regardless, and the group stays in step.
            transfer_ms = await asyncio.to_thread(
                receiver.receive, metas, body.bucket_bytes, lambda m: adapters[m.name]
            )
        except WeightSyncError as exc:
            ctx.receiver = None
            await asyncio.to_thread(receiver.close)
            ctx.metrics.updates.labels("failed").inc()
            raise api_error(
                502, f"receiving version {body.version} failed: {exc}", "weight_sync_error"
            ) from exc
        if refused is not None:
            ctx.metrics.updates.labels("rejected").inc()
            raise api_error(409, refused, "weight_sync_error")
        specs = [ParamSpec(n, weights[n].dtype, weights[n].shape) for n in names]
        buffers = table.shadow_buffers(specs)

        def merge_all() -> None:
            if receiver.ready is not None:
                receiver.ready.synchronize()
            for p in pairs:
                out = buffers[table.canonical(p.name)]
                merge(state.tensors[p.name], adapters[p.a.name], adapters[p.b.name], body.scale, out=out)

        merge_started = time.perf_counter()
        await asyncio.to_thread(merge_all)
        merge_ms = (time.perf_counter() - merge_started) * 1000
        receive_ms = (time.perf_counter() - started) * 1000
        try:
            swap = await asyncio.wrap_future(ctx.engine.swap_weights(body.version, buffers))
        except InferenceError as exc:
            raise api_error(503, f"version {body.version} not installed: {exc}", "server_error") from exc
        table.recycle(swap.replaced)
        state.version = swap.version
        request.app.state.lora_base = state
    ctx.metrics.receive_seconds.observe(receive_ms / 1000)
    ctx.metrics.stall_seconds.observe(swap.stall_ms / 1000)
    ctx.metrics.updates.labels("ok").inc()
    logger.info(
        "weights version %d in force from LoRA adapters (%d weights; transfer %.1f ms, merge %.1f ms, stall %.2f ms)",
        body.version,
        len(pairs),
        transfer_ms,
        merge_ms,
        swap.stall_ms,
    )
    return {
        "version": swap.version,
        "receive_ms": receive_ms,
        "stall_ms": swap.stall_ms,
        "transfer_ms": transfer_ms,
        "merge_ms": merge_ms,
    }
