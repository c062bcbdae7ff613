"""Smaller full-model pushes against real built-in servers (docs/weight-pushes.md).

Two real servers (in-process, the tiny model with an untied head, engine in bfloat16: the head
stays float32) joined over real gloo groups by a `WeightSender` playing a float32 trainer:

- `push_dtype="server"` + `delta_threshold=0`: after every push each server's weights equal the
  trainer's cast to the server's dtypes, bit for bit (checksums), the version label is exact, an
  unchanged tensor is not sent, a version where nothing moved in bf16 sends nothing (an empty
  update relabels), and a server that missed a version gets every tensor.
- `delta_threshold > 0`: every tensor a server holds is within the threshold of the trainer's and
  equal to the sender's held copy; tensors that moved less are not sent.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from fakes.server_thread import ServerThread

from stream_rl.inference.engine import Engine
from stream_rl.inference.model_maker import make_model
from stream_rl.weights import ServerEndpoint, WeightSender, weights_checksum

pytestmark = pytest.mark.integration

TOKEN = "t0ken"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return make_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0, tie_embeddings=False)


@pytest.fixture(scope="module")
def servers(model_dir: Path) -> Iterator[list[tuple[ServerThread, Engine]]]:
    engines = [Engine.load(model_dir, dtype="bfloat16", max_batch=4) for _ in range(2)]
    threads = [ServerThread(e, admin_token=TOKEN) for e in engines]
    for t in threads:
        t.__enter__()
    yield list(zip(threads, engines, strict=True))
    for t in threads:
        t.__exit__(None, None, None)


def trainer_weights(engine: Engine, seed: int) -> list[tuple[str, torch.Tensor]]:
    """float32 weights of the served model's layout (what an fp32 trainer holds)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (s.name, 0.05 * torch.randn(s.shape, generator=gen, dtype=torch.float32))
        for s in engine.parameters.specs()
    ]


def served(engine: Engine) -> list[tuple[str, torch.Tensor]]:
    return [(s.name, engine.parameters.get(s.name)) for s in engine.parameters.specs()]


def as_served(engine: Engine, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The trainer's tensors cast to the dtypes the server holds (round-to-nearest-even)."""
    dtypes = {s.name: engine.parameters.get(s.name).dtype for s in engine.parameters.specs()}
    return [(n, t.to(dtypes[n])) for n, t in named]


def version_of(server: ServerThread) -> int:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    return int(httpx.get(f"{server.url}/weights/version", headers=auth, timeout=10).json()["version"])


def test_bf16_wire_and_exact_delta_reach_every_server_bit_for_bit(
    servers: list[tuple[ServerThread, Engine]],
) -> None:
    (a, engine_a), (b, engine_b) = servers
    assert engine_a.model.lm_head.weight.dtype == torch.float32  # untied head kept float32
    assert engine_a.model.model.embed_tokens.weight.dtype == torch.bfloat16
    sender = WeightSender(
        [ServerEndpoint(a.url, TOKEN), ServerEndpoint(b.url, TOKEN)],
        master_port=0,
        timeout_s=30,
        push_dtype="server",
        delta_threshold=0.0,
    )
    try:
        assert sender.connect() == {}
        weights = trainer_weights(engine_a, seed=1)
        full_bytes = sum(t.numel() * engine_a.parameters.get(n).element_size() for n, t in weights)
        fp32_bytes = sum(t.numel() * 4 for _, t in weights)
        assert full_bytes < 0.6 * fp32_bytes  # all but the head travel as bf16

        def check(version: int, expected: list[tuple[str, torch.Tensor]]) -> None:
            for server, engine in servers:
                assert version_of(server) == version
                assert weights_checksum(served(engine)) == weights_checksum(as_served(engine, expected))

        report = sender.push(1, weights, 64 * 1024)
        assert report.failed == {}
        assert [report.per_server[s.url]["bytes"] for s in (a, b)] == [full_bytes, full_bytes]
        check(1, weights)

        # Version 2: two tensors move, the rest stays: only those two travel.
        moved = {"model.layers.0.mlp.up_proj.weight", "lm_head.weight"}
        weights = [(n, t + 0.01 if n in moved else t) for n, t in weights]
        report = sender.push(2, weights, 64 * 1024)
        sent = sum(
            engine_a.parameters.get(n).numel() * engine_a.parameters.get(n).element_size() for n in moved
        )
        assert {s: r["tensors"] for s, r in report.per_server.items()} == {a.url: 2.0, b.url: 2.0}
        assert report.per_server[a.url]["bytes"] == sent
        check(2, weights)

        # Version 3: the float32 weights change but not their bf16 roundings (the fp32 head stays):
        # nothing travels, the update is empty and only relabels the weights.
        before = weights
        weights = [(n, t if n == "lm_head.weight" else t.to(torch.bfloat16).float()) for n, t in weights]
        assert sum(not torch.equal(t, t0) for (_, t), (_, t0) in zip(weights, before, strict=True)) > 10
        report = sender.push(3, weights, 64 * 1024)
        assert report.per_server[a.url]["tensors"] == 0.0 and report.per_server[a.url]["bytes"] == 0.0
        check(3, weights)

        # b misses version 4 (dropped, as after a failed push), re-joins, and gets every tensor of 5.
        assert sender.drop(b.url)
        weights = [(n, t * 1.5 if "layers.1" in n else t) for n, t in weights]
        report = sender.push(4, weights, 64 * 1024)
        assert list(report.per_server) == [a.url] and version_of(b) == 3
        assert sender.connect() == {}
        weights = [(n, t - 0.02 if "layers.0.self_attn" in n else t) for n, t in weights]
        report = sender.push(5, weights, 64 * 1024)
        assert report.per_server[b.url]["bytes"] == full_bytes
        assert 0 < report.per_server[a.url]["bytes"] < full_bytes
        check(5, weights)
    finally:
        sender.close()


def test_a_threshold_keeps_every_tensor_within_it_and_sends_less(
    servers: list[tuple[ServerThread, Engine]],
) -> None:
    (a, engine_a), _ = servers
    threshold = 1e-3
    sender = WeightSender(
        [ServerEndpoint(a.url, TOKEN)],
        master_port=0,
        timeout_s=30,
        push_dtype="server",
        delta_threshold=threshold,
    )
    try:
        assert sender.connect() == {}
        weights = trainer_weights(engine_a, seed=2)
        first = sender.push(10, weights, 1 << 20).per_server[a.url]
        gen = torch.Generator().manual_seed(5)
        sent_tensors = []
        for version in range(11, 15):
            # every tensor drifts by up to 4e-4 a version; a few jump by 1e-2
            weights = [
                (
                    n,
                    t
                    + 4e-4 * (2 * torch.rand(t.shape, generator=gen) - 1)
                    + (1e-2 if i % 7 == version % 7 else 0),
                )
                for i, (n, t) in enumerate(weights)
            ]
            report = sender.push(version, weights, 1 << 20).per_server[a.url]
            sent_tensors.append(report["tensors"])
            assert version_of(a) == version
            expected = as_served(engine_a, weights)
            for (name, have), (_, want) in zip(served(engine_a), expected, strict=True):
                assert (have.float() - want.float()).abs().max() <= threshold, name
            assert sender._held is not None
            assert weights_checksum(served(engine_a)) == weights_checksum(sender._held.named())
        assert first["tensors"] == len(weights)
        assert min(sent_tensors) > 0 and max(sent_tensors) < len(weights)
    finally:
        sender.close()
