"""Sender -> receiver over real gloo groups, between real processes, through the HTTP contract.

The servers are `tests/fakes/weight_server.py` processes (the real `WeightReceiver` behind the
`/weights/*` endpoints); the trainer side runs in the test process. No Kafka, but real processes
and real torch.distributed groups, hence `integration`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Iterator
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Protocol

import httpx
import pytest
import torch
import torch.distributed as dist
from torch import nn

from stream_rl.errors import WeightSyncError
from stream_rl.weights import ServerEndpoint, TensorMeta, WeightSender, weights_checksum

pytestmark = pytest.mark.integration

FAKES = Path(__file__).parent.parent / "fakes"


def small_model() -> list[tuple[str, torch.Tensor]]:
    """A small model's parameters in all three wire dtypes, with odd sizes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(51, 16), nn.Linear(16, 33), nn.LayerNorm(33), nn.Linear(33, 51))
    model[1].to(torch.bfloat16)
    model[2].to(torch.float16)
    return [(name, p.detach().clone()) for name, p in model.named_parameters()]


def perturbed(named: list[tuple[str, torch.Tensor]], step: int) -> list[tuple[str, torch.Tensor]]:
    return [(name, (t.float() + 0.01 * step * torch.randn(t.shape)).to(t.dtype)) for name, t in named]


class Server:
    def __init__(self, process: BaseProcess, port: int) -> None:
        self.process = process
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

    def checksum(self, token: str | None = None) -> dict[str, object]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return dict(httpx.get(f"{self.url}/weights/checksum", headers=headers, timeout=10).json())

    def kill(self) -> None:
        if self.process.is_alive() and self.process.pid is not None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(timeout=10)


class Spawn(Protocol):
    def __call__(self, *options: dict[str, Any], port: int = 0) -> list[Server]: ...


@pytest.fixture(scope="module")
def forkserver() -> ForkServerContext:
    """Servers fork from one process that imported torch once (each import costs seconds here)."""
    sys.path.insert(0, str(FAKES))  # so that the forkserver finds `weight_server`
    ctx = mp.get_context("forkserver")
    assert isinstance(ctx, ForkServerContext)
    ctx.set_forkserver_preload(["torch", "stream_rl.weights", "weight_server"])
    return ctx


@pytest.fixture
def spawn(forkserver: ForkServerContext) -> Iterator[Spawn]:
    """Start fake servers for `small_model()`, one per options dict (see `weight_server.serve`)."""
    import weight_server

    metas = [TensorMeta.from_tensor(n, t).to_dict() for n, t in small_model()]
    started: list[Server] = []

    def start(*options: dict[str, Any], port: int = 0) -> list[Server]:
        servers = []
        for opts in options:
            receive, send = forkserver.Pipe(duplex=False)
            process = forkserver.Process(
                target=weight_server.serve, args=(metas,), kwargs={"port": port, "ready": send, **opts}
            )
            process.start()
            send.close()
            assert receive.poll(60), "fake weight server did not start"
            servers.append(Server(process, receive.recv()))
            started.append(servers[-1])
        return servers

    yield start
    for server in started:
        server.kill()


def test_push_is_bit_exact_with_the_default_group_initialised(spawn: Spawn) -> None:
    # The trainer may use the default group for data parallelism: the weight groups must not
    # touch it, nor be disturbed by it.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        (server,) = spawn({"token": "s3cret"})
        with (
            WeightSender([ServerEndpoint(server.url, "wrong")], master_port=0, timeout_s=2) as intruder,
            pytest.raises(WeightSyncError, match="401"),
        ):
            intruder.connect()

        sender = WeightSender([ServerEndpoint(server.url, "s3cret")], master_port=0, timeout_s=10)
        try:
            assert sender.connect() == {}
            assert sender.live_servers == [server.url]
            named = small_model()

            wrong_shape = [(n, t[:-1] if n == "3.bias" else t) for n, t in named]
            with pytest.raises(WeightSyncError, match=r"1 mismatched \(3\.bias: float32\[50\] here"):
                sender.push(1, wrong_shape, 1 << 20)
            with pytest.raises(WeightSyncError, match=r"1 missing \(0\.weight\)"):
                sender.push(1, named[1:], 1 << 20)
            assert server.checksum("s3cret")["version"] is None  # nothing was sent

            # 1 byte: one broadcast per tensor; 64: several small buckets; then one bucket.
            for version, bucket_bytes in enumerate([1, 64, 4096, 1 << 30], start=1):
                named = perturbed(named, version)
                report = sender.push(version, named, bucket_bytes)
                assert report.updated == [server.url] and report.failed == {}
                assert set(report.per_server[server.url]) >= {"receive_ms", "stall_ms", "broadcast_ms"}
                assert server.checksum("s3cret") == {"checksum": weights_checksum(named), "version": version}

            again = sender.push(4, named, 1 << 30)  # already there: nothing is sent
            assert again.updated == [server.url] and again.per_server == {}
        finally:
            sender.close()

        total = torch.ones(1)
        dist.all_reduce(total)
        assert dist.get_world_size() == 1 and total.item() == 1.0
    finally:
        dist.destroy_process_group()


def test_a_server_restarted_between_pushes_is_dropped_and_rejoins_in_a_new_group(spawn: Spawn) -> None:
    # Killed and restarted right after a push: no push failed, so the sender still counts it live
    # at that version; `drop` (the trainer found it holding an older one) makes it re-join afresh.
    kept, restarted_one = spawn({}, {})
    sender = WeightSender(
        [ServerEndpoint(s.url) for s in (kept, restarted_one)], master_port=0, timeout_s=5.0
    )
    try:
        assert sender.connect() == {}
        named = perturbed(small_model(), 2)
        assert set(sender.push(4, named, 256).updated) == {kept.url, restarted_one.url}
        restarted_one.kill()
        (back,) = spawn({}, port=restarted_one.port)
        assert sender.live_servers == [kept.url, back.url]  # nothing told the sender
        assert sender.drop(back.url) and not sender.drop(back.url)
        assert sender.live_servers == [kept.url]
        assert sender.connect() == {}
        again = sender.push(4, named, 256)
        assert list(again.per_server) == [back.url] and not again.failed
        assert back.checksum() == {"checksum": weights_checksum(named), "version": 4}
        assert kept.checksum() == {"checksum": weights_checksum(named), "version": 4}
    finally:
        sender.close()


def test_failed_servers_are_dropped_and_a_restarted_one_rejoins(spawn: Spawn) -> None:
    live, killed, hung, dying = spawn({}, {}, {"stall": True}, {"die_after": 2})
    timeout_s = 3.0
    urls = [s.url for s in (live, killed, hung, dying)]
    sender = WeightSender([ServerEndpoint(u) for u in urls], master_port=0, timeout_s=timeout_s)
    try:
        assert sender.connect() == {}
        assert sender.live_servers == urls
        killed.kill()
        named = perturbed(small_model(), 1)

        start = time.monotonic()
        report = sender.push(7, named, 256)
        elapsed = time.monotonic() - start

        assert report.updated == [live.url]
        assert set(report.failed) == {killed.url, hung.url, dying.url}
        assert "within" in report.failed[hung.url]  # dropped at the deadline
        assert elapsed < timeout_s + 2.0
        assert sender.live_servers == [live.url]
        assert live.checksum() == {"checksum": weights_checksum(named), "version": 7}

        # The killed server comes back on its address; the dead ones stay out.
        (restarted,) = spawn({}, port=killed.port)
        hung.kill()
        failures = sender.connect()
        assert set(failures) == {hung.url, dying.url}
        assert sender.live_servers == [live.url, restarted.url]
        # Re-broadcasting the current version reaches only the server that lacks it.
        again = sender.push(7, named, 256)
        assert set(again.updated) == {live.url, restarted.url}
        assert list(again.per_server) == [restarted.url]
        assert restarted.checksum() == {"checksum": weights_checksum(named), "version": 7}
    finally:
        sender.close()
