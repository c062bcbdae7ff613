"""The built-in sender's push of a LoRA version: the adapter tensors only (`POST /weights/update_lora`).

`WeightSender.push` hands a version here when its tensors carry adapters (`MergedWeights` from a
LoRA trainer, `stream_rl.weights.lora`). The flow is the full push's (one thread per server,
`POST` while the buckets are broadcast, a failing server dropped and reported, the others
updated), with the adapters as the tensors and the LoRA route as the request; before anything
is sent, the adapters are checked against each server's `GET /weights/meta` (each pair's shapes
against its weight's).

Written against `WeightSender`'s internals (its links, `_deliver`, `_drop`) on purpose: the
transport, deadlines and failure handling are that class's, and this module only changes what
travels and which route receives it.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from dataclasses import replace
from typing import Any

from stream_rl.errors import WeightSyncError
from stream_rl.weights.buckets import TensorMeta, plan_buckets
from stream_rl.weights.lora import LoraTensors, pair_metas
from stream_rl.weights.server_client import ServerClient, UpdateAnswer

log = logging.getLogger(__name__)

ROUTE = "/weights/update_lora"


class LoraClient:
    """A server's client whose `update` posts the LoRA route (what `WeightSender._deliver` calls)."""

    def __init__(self, client: ServerClient, lora: LoraTensors) -> None:
        self.client = client
        self.endpoint = client.endpoint
        self.lora = lora

    def update(
        self, *, version: int, metas: list[TensorMeta], bucket_bytes: int, timeout_s: float
    ) -> UpdateAnswer:
        body: dict[str, Any] = {
            "version": version,
            "tensors": [m.to_dict() for m in metas],
            "bucket_bytes": bucket_bytes,
            "scale": self.lora.scale,
            "base_checksum": self.lora.base_checksum,
        }
        data = self.client._call("POST", ROUTE, timeout_s, body)
        try:
            answer = UpdateAnswer(
                version=int(data["version"]),
                receive_ms=float(data["receive_ms"]),
                stall_ms=float(data["stall_ms"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightSyncError(
                f"POST {self.endpoint.base}{ROUTE}: malformed answer {data!r:.200}"
            ) from exc
        if answer.version != version:
            raise WeightSyncError(
                f"POST {self.endpoint.base}{ROUTE}: server installed version {answer.version}, expected {version}"
            )
        return answer


def push_adapters(sender: Any, version: int, lora: LoraTensors, bucket_bytes: int, report: Any) -> Any:
    """Push `version` as `lora`'s adapter tensors to every live server of `sender` (a `WeightSender`)
    not already holding it; fills and returns `report` (an empty `PushReport` of `version`). Typed
    loosely: `stream_rl.weights.sender` imports this module, not the other way round."""
    named = lora.named()
    metas = [TensorMeta.from_tensor(name, tensor) for name, tensor in named]
    live = [link for link in sender._links.values() if link.group is not None]
    targets = [link for link in live if link.version != version]
    for link in targets:
        try:
            pair_metas(metas, link.metas or {})
        except WeightSyncError as exc:
            raise WeightSyncError(f"{link.url}: {exc}") from exc
    plan = plan_buckets(metas, bucket_bytes)
    sources = [tensor for _, tensor in named]
    report.updated = [link.url for link in live if link.version == version]
    if targets:
        deadline = time.monotonic() + sender.timeout_s
        pool = cf.ThreadPoolExecutor(max_workers=2 * len(targets), thread_name_prefix="weights-push")
        try:
            futures = {
                link.url: pool.submit(
                    sender._deliver,
                    replace(link, client=LoraClient(link.client, lora)),
                    version,
                    metas,
                    plan,
                    sources,
                    bucket_bytes,
                    deadline,
                    pool,
                )
                for link in targets
            }
            cf.wait(futures.values(), timeout=sender.timeout_s + 4.0)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        nbytes = float(lora.nbytes)
        for link in targets:
            future = futures[link.url]
            outcome = future.result() if future.done() else None
            if outcome is not None and outcome.timings is not None:
                link.version = version
                report.updated.append(link.url)
                report.per_server[link.url] = {**outcome.timings, "bytes": nbytes, "lora": 1.0}
                report.broadcast_ms = max(report.broadcast_ms, outcome.timings["broadcast_ms"])
            else:
                reason = (
                    outcome.error if outcome is not None else "delivery did not finish"
                ) or "unknown failure"
                report.failed[link.url] = reason
                log.warning("weight sync: dropping %s from version %d on: %s", link.url, version, reason)
                sender._drop(link)
    sender.version = version
    return report
