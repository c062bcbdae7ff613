"""The SGLang sender over real HTTP and a real torch.distributed group (gloo), against a stand-in
for SGLang 0.5.23's weight routes (sglang_fake_server.py: an emulation, not SGLang; the NCCL path
against a real SGLang is tests/gpu/test_engine_adapters.py)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from stream_rl.common.ports import free_port
from stream_rl.weights import ServerEndpoint
from stream_rl.weights.adapters.sglang import SGLangWeightSender
from stream_rl.weights.adapters.sglang_group import TorchCollectives

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "sglang_fake_server.py"), str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def state(url: str) -> dict:  # type: ignore[type-arg]
    return httpx.get(f"{url}/test_state", timeout=10).json()  # type: ignore[no-any-return]


def sender_for(url: str, pause: str = "keep") -> SGLangWeightSender:
    return SGLangWeightSender(
        [ServerEndpoint(url)], timeout_s=20.0, pause=pause, collectives=TorchCollectives("gloo")
    )


def test_buckets_reach_the_server_bit_exact_and_every_group_is_destroyed(server: str) -> None:
    weights = [
        ("a.weight", torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)),
        ("a.bias", torch.tensor([0.5, -1.0, 3.25], dtype=torch.bfloat16)),
        ("norm", torch.tensor([1.5, 2.5, 3.5], dtype=torch.float32)),  # a dtype change: a new bucket
        ("big", torch.linspace(-1, 1, 40, dtype=torch.bfloat16)),  # 80 bytes > the bucket: alone
    ]
    first = sender_for(server)
    try:
        assert first.connect() == {}
        report = first.push(3, weights, bucket_bytes=64)
        assert report.updated == [server] and report.failed == {}
        seen = state(server)
        for name, tensor in weights:
            assert seen["weights"][name] == tensor.float().flatten().tolist()
        assert seen["label"] == "3" and seen["paused"] is None and seen["session"] is False
        updates = [c for c in seen["calls"] if c == "/update_weights_from_distributed"]
        assert len(updates) == 3  # [a.weight, a.bias] (bf16, 18 bytes), [norm] (fp32), [big]
        assert len(seen["groups"]) == 1
    finally:
        first.close()
    assert state(server)["groups"] == []

    # A second trainer process (here: a second sender) joins the same server under a new name.
    second = sender_for(server, pause="drain")
    try:
        assert second.connect() == {}
        assert second.push(4, weights, bucket_bytes=1 << 20).updated == [server]
        assert state(server)["label"] == "4"
    finally:
        second.close()
    assert state(server)["groups"] == []


def test_a_rendezvous_nobody_joins_fails_within_the_timeout() -> None:
    from stream_rl.weights.adapters.sglang_group import join_group

    with pytest.raises(RuntimeError):  # torch's DistStoreError: the server never connected
        join_group(
            master_addr="127.0.0.1",
            master_port=free_port(),
            world_size=2,
            group_name="nobody",
            timeout_s=1.0,
            backend="gloo",
        )
