"""trainer.weight_transport on CPU: what runs (gloo, auto -> gloo, a bf16 model with an fp32 head
pushed whole), what is refused in one line (cuda_ipc and nccl without CUDA), the server's
/weights/device and /weights/*_ipc answers, and the receiver's deadline and abort."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fakes.server_thread import ServerThread
from fakes.training import make_tiny_model
from pydantic import SecretStr

from stream_rl.config import load_config
from stream_rl.errors import WeightSyncError
from stream_rl.inference.engine import Engine
from stream_rl.train.push import make_sender
from stream_rl.train.step import load_model
from stream_rl.weights import ServerEndpoint, TensorMeta, WeightSender, weights_checksum
from stream_rl.weights.receiver import WeightReceiver
from stream_rl.weights.sender_choice import make_builtin_sender

pytestmark = pytest.mark.unit
TOKEN = "t0k"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("m") / "untied", tie_embeddings=False)


@pytest.fixture(scope="module")
def server(untied: Path):  # type: ignore[no-untyped-def]
    with ServerThread(Engine.load(untied, dtype="bfloat16", max_batch=4), admin_token=TOKEN) as running:
        yield running


def test_auto_on_a_cpu_trainer_is_gloo_and_gpu_transports_are_refused() -> None:
    with make_builtin_sender(
        [ServerEndpoint("http://127.0.0.1:1")],
        transport="auto",
        trainer_device="cpu",
        master_addr="127.0.0.1",
        master_port=0,
        timeout_s=5,
    ) as sender:
        assert isinstance(sender, WeightSender) and sender.backend == "gloo"
    for transport in ("nccl", "cuda_ipc"):
        with pytest.raises(WeightSyncError, match=f"{transport} needs a CUDA trainer"):
            make_builtin_sender(
                [], transport=transport, trainer_device="cpu", master_addr="x", master_port=0, timeout_s=5
            )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_the_ipc_sender_refuses_without_cuda() -> None:
    from stream_rl.weights.ipc_sender import IpcWeightSender

    with pytest.raises(WeightSyncError, match="cuda_ipc needs CUDA"):
        IpcWeightSender([])


def test_a_cpu_server_reports_its_device_and_refuses_cuda_ipc(server: ServerThread) -> None:
    url = f"{server.url}/weights"
    assert httpx.get(f"{url}/device", headers=AUTH).json() == {"device": "cpu", "type": "cpu", "uuid": None}
    assert httpx.get(f"{url}/device").status_code == 401
    join = httpx.post(f"{url}/init_ipc", json={"device_uuid": "GPU-x", "torch_version": "2"}, headers=AUTH)
    assert join.status_code == 409
    message = join.json()["error"]["message"]
    assert message == "cuda_ipc needs a server on CUDA; this one runs on cpu (use gloo)"
    meta = httpx.get(f"{url}/meta", headers=AUTH).json()
    update = {"version": 1, "tensors": meta, "bucket_bytes": 1 << 20, "buckets": []}
    answer = httpx.post(f"{url}/update_ipc", json=update, headers=AUTH)
    assert answer.status_code == 409 and "init_ipc first" in answer.json()["error"]["message"]
    bad = httpx.post(f"{url}/update_ipc", json={**update, "buckets": [{"device": -1}]}, headers=AUTH)
    assert bad.status_code == 400


def test_a_bf16_model_with_an_fp32_head_is_pushed_whole_over_gloo(untied: Path, server: ServerThread) -> None:
    config = load_config(
        None,
        [
            f"inference.servers=[{{url: '{server.url}'}}]",
            "model.dtype=bfloat16",
            "trainer.sync_master_port=0",
            "trainer.update_timeout_s=30",
        ],
    )
    model: Any = load_model(untied, "bfloat16", "cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    assert dict(named)["lm_head.weight"].dtype == torch.float32
    config.inference.admin_token = SecretStr(TOKEN)
    sender = make_sender(config)
    assert isinstance(sender, WeightSender) and sender.backend == "gloo"  # auto on a CPU trainer
    try:
        assert sender.connect() == {}
        report = sender.push(7, named, 1 << 16)
    finally:
        sender.close()
    assert report.failed == {} and report.updated == [server.url]
    table = server.engine.parameters
    served = [(s.name, table.get(s.name)) for s in table.specs()]
    assert weights_checksum(served) == weights_checksum(named)
    assert server.engine.version == 7


class _NeverDone:
    """An NCCL work whose CUDA event never fires (a trainer that died mid-broadcast)."""

    def is_completed(self) -> bool:
        return False

    def wait(self) -> bool:  # pragma: no cover - must not be reached
        raise AssertionError("waited on a collective that never completes")


class _StuckGroup:
    backend = "nccl"
    device = torch.device("cpu")
    timeout_s = 0.3

    def __init__(self) -> None:
        self.aborted = False

    def staging(self, slot: int, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def broadcast(self, tensor: torch.Tensor, timeout_s: float) -> _NeverDone:
        return _NeverDone()

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        pass


def test_a_receive_that_never_completes_gives_up_at_the_deadline_and_aborts() -> None:
    receiver = WeightReceiver.__new__(WeightReceiver)  # a real receiver around a stuck group
    group = _StuckGroup()
    receiver.timeout_s, receiver._broken, receiver._group = 0.3, None, group  # type: ignore[assignment]
    receiver.stream, receiver.ready = None, None
    metas = [TensorMeta("a", "float32", (4,)), TensorMeta("b", "float32", (4,))]
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="within the deadline"):
        receiver.receive(metas, 64, lambda m: torch.zeros(m.shape))
    assert 0.25 < time.monotonic() - start < 2.0
    assert group.aborted
    with pytest.raises(WeightSyncError, match="broken"):
        _ = receiver.group
