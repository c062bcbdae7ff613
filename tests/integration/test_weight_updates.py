"""In-flight weight updates end to end: a real server (in-process, real tiny model) joins a real
gloo group whose rank 0 is this test, playing the trainer with `WeightSender`.

- After an update with random new weights, greedy output equals transformers' greedy decode
  with those weights, and the served parameters equal the sent tensors bit for bit.
- A generation that spans an update returns two version spans and finishes normally; requests
  sent during the update are all answered.
- The route's error paths (receive failure -> 502 and membership dropped) with a fake receiver.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fakes.server_thread import ServerThread, load_weights, random_weights
from transformers import AutoModelForCausalLM

from stream_rl.config import SamplingConfig
from stream_rl.errors import WeightSyncError
from stream_rl.inference.builtin_client import BuiltinClient
from stream_rl.inference.engine import Engine
from stream_rl.inference.model_maker import make_model
from stream_rl.inference.parameters import DTYPES
from stream_rl.weights import ServerEndpoint, WeightSender

pytestmark = pytest.mark.integration

TOKEN = "t0ken"
PROMPT = [4, 57, 61, 49, 58, 59, 67, 1, 5]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return make_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)


@pytest.fixture
def sender_for() -> Iterator[Callable[[ServerThread], WeightSender]]:
    senders: list[WeightSender] = []

    def connect(server: ServerThread) -> WeightSender:
        sender = WeightSender(
            [ServerEndpoint(server.url, TOKEN)], master_port=0, backend="gloo", timeout_s=30
        )
        senders.append(sender)
        assert sender.connect() == {}
        return sender

    yield connect
    for sender in senders:
        sender.close()


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_update_installs_exact_bits_and_greedy_matches_transformers(
    model_dir: Path, sender_for: Callable[[ServerThread], WeightSender], dtype: str
) -> None:
    engine = Engine.load(model_dir, dtype=dtype, max_batch=4)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).eval()
    new = random_weights(reference, seed=9)
    load_weights(reference, new)
    with ServerThread(engine, admin_token=TOKEN) as server:
        sender = sender_for(server)
        report = sender.push(3, new, bucket_bytes=64 * 1024)
        assert report.updated == [server.url] and report.failed == {}
        assert set(report.per_server[server.url]) >= {"receive_ms", "stall_ms"}
        for name, tensor in new:
            assert torch.equal(as_bytes(engine.parameters.get(name)), as_bytes(tensor)), name
        # the tied lm_head sees the new embedding too
        assert engine.model.lm_head.weight.data_ptr() == engine.model.model.embed_tokens.weight.data_ptr()
        body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        choice = httpx.post(f"{server.url}/v1/completions", json=body).json()["choices"][0]
        assert httpx.get(f"{server.url}/health").json()["version"] == 3
    with torch.inference_mode():
        out = reference.generate(
            torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert choice["token_ids"] == out[0, len(PROMPT) :].tolist()
    assert choice["version_spans"] == [{"version": 3, "start": 0}]
    assert len(set(choice["token_ids"])) > 3


def test_generation_spanning_an_update_has_two_spans_and_requests_during_it_are_answered(
    model_dir: Path, sender_for: Callable[[ServerThread], WeightSender]
) -> None:
    engine = Engine.load(model_dir, max_batch=32, seed=0)
    new = random_weights(engine.model, seed=4)
    with ServerThread(engine, admin_token=TOKEN) as server:
        sender = sender_for(server)

        async def scenario() -> tuple[Any, list[Any], Any]:
            long_body = {"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "logprobs": 0}
            async with BuiltinClient(server.url) as client, httpx.AsyncClient(timeout=60) as http:
                long_call = asyncio.create_task(http.post(f"{server.url}/v1/completions", json=long_body))
                while engine.stats().generated_tokens < 50:  # the long one is decoding
                    await asyncio.sleep(0.005)
                push = asyncio.create_task(asyncio.to_thread(sender.push, 1, new, 16 * 1024))  # many buckets
                short = SamplingConfig(max_tokens=16, temperature=1.0)
                during = [asyncio.create_task(client.complete([4, 6 + i, 1, 5], short)) for i in range(16)]
                report = await push
                return (await long_call).json()["choices"][0], await asyncio.gather(*during), report

        long_choice, during, report = asyncio.run(scenario())
    assert report.updated == [server.url]
    # the swap paused decoding only briefly: the transfer itself overlapped decoding
    assert report.per_server[server.url]["stall_ms"] < 50
    assert [s["version"] for s in long_choice["version_spans"]] == [0, 1]
    assert 50 <= long_choice["version_spans"][1]["start"] < 1000
    assert long_choice["finish_reason"] == "length" and len(long_choice["token_ids"]) == 1000
    assert len(long_choice["logprobs"]["token_logprobs"]) == 1000
    assert len(during) == 16
    for completion in during:
        assert completion.token_ids and completion.version_spans[0].start == 0
        assert {s.version for s in completion.version_spans} <= {0, 1}


class FakeReceiver:
    """Fills the shadow buffers from given tensors, or fails like a broken group."""

    ready = None  # CPU: the bytes are in place when receive returns

    def __init__(self, tensors: dict[str, torch.Tensor] | None, **group: Any) -> None:
        self.tensors, self.group, self.closed = tensors, group, False

    def receive(self, metas: list[Any], bucket_bytes: int, into: Callable[[Any], torch.Tensor]) -> float:
        if self.tensors is None:
            raise WeightSyncError("peer vanished")
        for meta in metas:
            into(meta).copy_(self.tensors[meta.name])
        return 1.0

    def close(self) -> None:
        self.closed = True


def test_update_route_with_fake_receiver(model_dir: Path) -> None:
    engine = Engine.load(model_dir, max_batch=4)
    new = dict(random_weights(engine.model, seed=6))
    made: list[FakeReceiver] = []
    tensors: list[dict[str, torch.Tensor] | None] = [new]

    def factory(**group: Any) -> FakeReceiver:
        made.append(FakeReceiver(tensors[0], **group))
        return made[-1]

    auth = {"Authorization": f"Bearer {TOKEN}"}
    join = {"master_addr": "127.0.0.1", "master_port": 5555, "rank": 1, "world_size": 2, "backend": "gloo"}
    with ServerThread(engine, admin_token=TOKEN, receiver_factory=factory) as server:
        url = f"{server.url}/weights"
        assert httpx.post(f"{url}/init_group", json=join, headers=auth).json()["status"] == "joined"
        assert made[0].group["timeout_s"] == 30.0 and made[0].group["device"] == "cpu"
        meta = httpx.get(f"{url}/meta", headers=auth).json()
        answer = httpx.post(
            f"{url}/update", json={"version": 2, "tensors": meta[:3], "bucket_bytes": 1 << 16}, headers=auth
        )
        assert answer.status_code == 200 and answer.json()["version"] == 2
        assert set(answer.json()) == {"version", "receive_ms", "stall_ms"}
        for spec in meta[:3]:
            assert torch.equal(engine.parameters.get(spec["name"]), new[spec["name"]])
        assert httpx.get(f"{url}/version", headers=auth).json() == {"version": 2}
        # re-joining replaces (and closes) the previous membership
        tensors[0] = None
        httpx.post(f"{url}/init_group", json=join, headers=auth)
        assert made[0].closed and not made[1].closed
        failed = httpx.post(
            f"{url}/update", json={"version": 3, "tensors": meta[:3], "bucket_bytes": 1 << 16}, headers=auth
        )
        assert failed.status_code == 502 and "peer vanished" in failed.json()["error"]["message"]
        assert made[1].closed and engine.version == 2  # old weights stay; membership dropped
        again = httpx.post(
            f"{url}/update", json={"version": 3, "tensors": meta[:3], "bucket_bytes": 1 << 16}, headers=auth
        )
        assert again.status_code == 409
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'stream_rl_inference_weight_updates_total{outcome="ok"} 1.0' in metrics
        assert 'stream_rl_inference_weight_updates_total{outcome="failed"} 1.0' in metrics
