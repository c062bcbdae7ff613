"""The engine adapters' shared orchestration (joining, dropping, version skipping), engine faked.

The vLLM and SGLang calls themselves need a GPU: tests/gpu/test_engine_adapters.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from stream_rl.errors import WeightSyncError
from stream_rl.weights import ServerEndpoint
from stream_rl.weights.adapters.base import EngineSender, dtype_name

pytestmark = pytest.mark.unit


class FakeEngine(EngineSender):
    engine = "fake"

    def __init__(self, urls: list[str], *, refuse: set[str], fail: set[str], timeout_s: float = 5.0) -> None:
        super().__init__([ServerEndpoint(u) for u in urls], timeout_s=timeout_s)
        self.refuse, self.fail = refuse, fail
        self.pushed: list[tuple[str, int, int]] = []

    def _join(self, server: ServerEndpoint, port: int) -> Any:
        if server.url in self.refuse:
            raise WeightSyncError(f"{server.url} refused")
        assert port > 0
        return f"group:{server.url}"

    def _update(
        self,
        server: ServerEndpoint,
        handle: Any,
        version: int,
        named_tensors: Sequence[tuple[str, torch.Tensor]],
        bucket_bytes: int,
    ) -> dict[str, float]:
        assert handle == f"group:{server.url}"
        if server.url in self.fail:
            raise WeightSyncError("broadcast failed")
        self.pushed.append((server.url, version, len(named_tensors)))
        return {"receive_ms": 1.0, "stall_ms": 0.5}


def test_failures_are_dropped_and_a_current_version_reaches_only_rejoined_servers() -> None:
    urls = ["http://a", "http://b", "http://c"]
    sender = FakeEngine(urls, refuse={"http://c"}, fail={"http://b"})
    tensors = [("w", torch.zeros(2, dtype=torch.bfloat16))]
    try:
        assert set(sender.connect()) == {"http://c"}
        assert sender.live_servers == ["http://a", "http://b"]

        report = sender.push(1, tensors, 1 << 20)
        assert report.updated == ["http://a"] and set(report.failed) == {"http://b"}
        assert report.per_server["http://a"]["stall_ms"] == 0.5
        assert sender.live_servers == ["http://a"]

        sender.refuse, sender.fail = set(), set()
        assert sender.connect() == {}
        again = sender.push(1, tensors, 1 << 20)
        assert set(again.updated) == set(urls)
        assert sorted(again.per_server) == ["http://b", "http://c"]
        assert sender.pushed == [("http://a", 1, 1), ("http://b", 1, 1), ("http://c", 1, 1)]
    finally:
        sender.close()


def test_connect_raises_when_no_server_joins() -> None:
    with (
        FakeEngine(["http://a"], refuse={"http://a"}, fail=set()) as sender,
        pytest.raises(WeightSyncError, match="no fake server joined"),
    ):
        sender.connect()


def test_dtype_names_are_the_engines_spelling() -> None:
    assert dtype_name(torch.zeros(1, dtype=torch.bfloat16)) == "bfloat16"
    assert dtype_name(torch.zeros(1)) == "float32"


def test_drop_takes_a_live_server_out_so_that_connect_rejoins_it_afresh() -> None:
    released: list[Any] = []

    class Releasing(FakeEngine):
        def _release(self, handle: Any, *, pending: bool) -> None:
            released.append((handle, pending))

    tensors = [("w", torch.zeros(2, dtype=torch.bfloat16))]
    with Releasing(["http://a", "http://b"], refuse=set(), fail=set()) as sender:
        sender.connect()
        sender.push(3, tensors, 1 << 20)
        assert sender.drop("http://b") and not sender.drop("http://b") and not sender.drop("http://x")
        assert sender.live_servers == ["http://a"]
        assert released == [("group:http://b", True)]  # off the caller's thread: the peer may be gone
        assert sender.connect() == {}
        again = sender.push(3, tensors, 1 << 20)
        assert list(again.per_server) == ["http://b"]  # the version again, to it only
