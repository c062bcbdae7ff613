"""LoRA versions pushed to real built-in servers (in-process, real tiny model, real gloo groups).

- A LoRA trainer's versions through `WeightSender`: only the adapter bytes travel; the served
  weights then checksum as the trainer's merged weights, equal a float64 reference of
  `W0 + (alpha/r) B A` for the targeted weights and the base elsewhere, at each version (re-merged
  from the base, not stacked); a server whose weights are not the base refuses (409) and is
  dropped while the other is updated.
- The trainer stage with LoRA (in-memory topics, a real server): each version's `push_bytes` is
  the adapters' bytes, and the checksum it publishes is the one the server then serves.
- An outside client written from docs/weights-protocol.md (section "LoRA updates"; httpx and
  torch.distributed only) installs adapters and reads back the formula's weights.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import random
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist
from fakes.server_thread import ServerThread, random_weights
from fakes.training import make_sample
from models import cached_model

from stream_rl.config import RunConfig
from stream_rl.inference.engine import Engine
from stream_rl.train.backends import build_trainer
from stream_rl.weights import ServerEndpoint, WeightSender, weights_checksum
from stream_rl.weights.lora import adapters_of

pytestmark = pytest.mark.integration

TOKEN = "t0ken"
TARGETS = ["q_proj", "v_proj"]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    torch.set_num_threads(1)
    return cached_model("tiny")


def served(engine: Engine) -> list[tuple[str, torch.Tensor]]:
    table = engine.parameters
    return [(s.name, table.get(s.name)) for s in table.specs()]


def test_a_lora_trainer_pushes_only_adapters_and_the_server_serves_the_merged_weights(
    model_dir: Path, tmp_path: Path
) -> None:
    cfg = RunConfig.model_validate(
        {
            "model": {"path": str(model_dir)},
            "runs_dir": str(tmp_path),
            "trainer": {"lr": 5e-2, "lora": {"rank": 4, "alpha": 8.0, "target_modules": TARGETS}},
        }
    )
    trainer = build_trainer(cfg)
    base = {n: t.clone() for n, t in served(Engine.load(model_dir, max_batch=2))}
    full_bytes = sum(t.numel() * t.element_size() for t in base.values())
    rng = random.Random(0)
    good, foreign = Engine.load(model_dir, max_batch=4), Engine.load(model_dir, max_batch=4)
    with ServerThread(good, admin_token=TOKEN) as a, ServerThread(foreign, admin_token=TOKEN) as b:
        # The second server holds other weights than the trainer's base (a full push of random ones).
        with WeightSender([ServerEndpoint(b.url, TOKEN)], master_port=0, timeout_s=30) as other:
            other.connect()
            assert other.push(1, random_weights(foreign.model, seed=3), 1 << 20).failed == {}
        sender = WeightSender(
            [ServerEndpoint(a.url, TOKEN), ServerEndpoint(b.url, TOKEN)], master_port=0, timeout_s=30
        )
        try:
            assert sender.connect() == {}
            for version in (1, 2):
                vocab = trainer.vocab_size
                samples = [make_sample(rng, key=f"v{version}.{i}", vocab_size=vocab) for i in range(4)]
                trainer.micro_batch(samples)
                trainer.optimizer_step(len(samples))
                with trainer.full_weights() as named:
                    lora = adapters_of(named)
                    assert lora is not None
                    report = sender.push(version, named, bucket_bytes=1 << 20)
                    expected = weights_checksum(named)
                assert report.updated == [a.url]
                if version == 1:
                    assert "not the trainer's base model" in report.failed[b.url]
                # Only the adapter tensors travelled: A [4, in] and B [out, 4] per targeted weight.
                sent = report.per_server[a.url]["bytes"]
                rank_bytes = 4 * 4  # rank 4, float32
                assert sent == lora.nbytes == sum(rank_bytes * sum(base[n].shape) for n, _, _ in lora.pairs)
                assert sent < full_bytes / 20
                assert weights_checksum(served(good)) == expected == trainer.checksum()
                assert httpx.get(
                    f"{a.url}/weights/version", headers={"Authorization": f"Bearer {TOKEN}"}
                ).json() == {"version": version}
                # The float64 formula, written here: the targeted weights moved, the rest is the base.
                pairs = {name: (A, B) for name, A, B in lora.pairs}
                assert len(pairs) == 2 * len(TARGETS)  # the tiny preset's 2 layers
                for name, tensor in served(good):
                    if name in pairs:
                        A, B = (t.to(torch.float64) for t in pairs[name])
                        want = (base[name].to(torch.float64) + 2.0 * (B @ A)).to(tensor.dtype)
                        assert torch.equal(tensor, want), name
                        assert not torch.equal(tensor, base[name]), name
                    else:
                        assert torch.equal(tensor, base[name]), name
        finally:
            sender.close()


def checksum_from_the_doc(named: list[tuple[str, str, list[int], torch.Tensor]]) -> str:
    """docs/weights-protocol.md, "LoRA updates": sha256 over each parameter's header and bytes."""
    digest = hashlib.sha256()
    for name, dtype, shape, tensor in named:
        raw = tensor.contiguous().reshape(-1).view(torch.uint8)
        digest.update(f"{name}\0{dtype}\0{','.join(map(str, shape))}\0{raw.numel()}\0".encode())
        digest.update(raw.numpy().tobytes())
    return digest.hexdigest()


def test_an_outside_client_following_the_doc_installs_lora_adapters(model_dir: Path) -> None:
    engine = Engine.load(model_dir, max_batch=4)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with ServerThread(engine, admin_token=TOKEN) as server, cf.ThreadPoolExecutor(2) as pool:
        http = httpx.Client(base_url=server.url, headers=auth, timeout=60)
        metas = http.get("/weights/meta").json()
        # The base checksum: this client knows the base (it is the model the server was started from).
        params = dict(engine.model.named_parameters())
        base = {m["name"]: params[m["name"]].detach().clone() for m in metas}
        base_checksum = checksum_from_the_doc(
            [(m["name"], m["dtype"], m["shape"], base[m["name"]]) for m in metas]
        )
        store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=30), wait_for_workers=False)
        body = {
            "master_addr": "127.0.0.1",
            "master_port": store.port,
            "rank": 1,
            "world_size": 2,
            "backend": "gloo",
        }
        joined = pool.submit(http.post, "/weights/init_group", json=body)
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timedelta(seconds=30)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        pg = dist.ProcessGroupGloo(store, 0, 2, opts)
        bopts = dist.BroadcastOptions()
        bopts.rootRank = 0
        pg.broadcast([torch.tensor([0x5354524D], dtype=torch.int64)], bopts).wait()
        assert joined.result().status_code == 200, joined.result().text

        # Rank-2 adapters for every attention output projection, in one bucket.
        gen = torch.Generator().manual_seed(1)
        targets = [m for m in metas if m["name"].endswith("o_proj.weight")]
        tensors, adapters = [], {}
        for m in targets:
            out, inner = m["shape"]
            A, B = torch.randn(2, inner, generator=gen), torch.randn(out, 2, generator=gen)
            adapters[m["name"]] = (A, B)
            tensors += [
                {"name": m["name"] + ".lora_A", "dtype": "float32", "shape": [2, inner], "t": A},
                {"name": m["name"] + ".lora_B", "dtype": "float32", "shape": [out, 2], "t": B},
            ]
        update = {
            "version": 5,
            "tensors": [{k: v for k, v in t.items() if k != "t"} for t in tensors],
            "bucket_bytes": 1 << 20,
            "scale": 0.25,
            "base_checksum": base_checksum,
        }
        reply = pool.submit(http.post, "/weights/update_lora", json=update)
        pg.broadcast([torch.cat([t["t"].reshape(-1).view(torch.uint8) for t in tensors])], bopts).wait()
        answer = reply.result()
        assert answer.status_code == 200, answer.text
        assert answer.json()["version"] == 5 and {"transfer_ms", "merge_ms", "stall_ms"} <= set(answer.json())
        expected = dict(base)
        for name, (A, B) in adapters.items():
            delta = B.to(torch.float64) @ A.to(torch.float64)
            expected[name] = (base[name].to(torch.float64) + 0.25 * delta).to(torch.float32)
            assert not torch.equal(expected[name], base[name])
        assert all(torch.equal(t, expected[n]) for n, t in served(engine))
        # A wrong base checksum: the adapters are received (the group stays in step) but refused
        # (409), the weights stay; the next update on the same group is installed.
        wrong = {**update, "version": 6, "base_checksum": "0" * 64}
        reply = pool.submit(http.post, "/weights/update_lora", json=wrong)
        pg.broadcast([torch.cat([t["t"].reshape(-1).view(torch.uint8) for t in tensors])], bopts).wait()
        refused = reply.result()
        assert refused.status_code == 409 and "not the trainer's base" in refused.text
        assert http.get("/weights/version").json() == {"version": 5}
        reply = pool.submit(http.post, "/weights/update_lora", json={**update, "version": 7})
        pg.broadcast([torch.cat([t["t"].reshape(-1).view(torch.uint8) for t in tensors])], bopts).wait()
        assert reply.result().status_code == 200 and http.get("/weights/version").json() == {"version": 7}
        # The same adapters again: merged into the kept base, not into the served weights.
        assert all(torch.equal(t, expected[n]) for n, t in served(engine))


def test_the_trainer_stage_with_lora_pushes_adapters_and_publishes_the_served_checksum(
    tmp_path: Path,
) -> None:
    """The stage itself (in-memory topics, a real server): each version's `WeightVersion` names the
    bytes the sender pushed (the adapters') and the checksum the server then serves."""
    from fakes.training import make_batches, setup_topics

    from stream_rl.contracts import WeightVersion
    from stream_rl.kafka.memory import MemoryTransport
    from stream_rl.kafka.serde import default_serde
    from stream_rl.kafka.topics import WEIGHT_VERSIONS
    from stream_rl.stages import trainer as trainer_stage

    model_dir = cached_model("tiny")
    engine = Engine.load(model_dir, max_batch=2)
    transport = MemoryTransport()
    names = setup_topics(transport, "r1", make_batches(4, 2, seed=2))
    with ServerThread(engine, admin_token=TOKEN) as server:
        cfg = RunConfig.model_validate(
            {
                "run": "r1",
                "runs_dir": str(tmp_path / "runs"),
                "model": {"path": str(model_dir)},
                "inference": {"servers": [{"url": server.url}], "admin_token": TOKEN},
                "trainer": {
                    "samples_per_step": 4,
                    "lr": 1e-2,
                    "sync_master_port": 0,
                    "lora": {"rank": 2, "target_modules": TARGETS},
                },
            }
        )
        stats = trainer_stage.run(cfg, transport, max_steps=2, idle_timeout_s=0.5)
        assert stats.version == 2
        serde = default_serde()
        wvs = [serde.decode(m.value, WeightVersion) for m in transport.messages(names.topic(WEIGHT_VERSIONS))]
        assert [w.version for w in wvs] == [0, 1, 2] and all(w.servers_updated == [server.url] for w in wvs)
        assert weights_checksum(served(engine)) == wvs[-1].checksum == stats.checksum
        targeted = [t for n, t in served(engine) if n.endswith(".weight") and n.rsplit(".", 2)[-2] in TARGETS]
        assert len(targeted) == 4
        adapter_bytes = sum(4 * 2 * sum(t.shape) for t in targeted)  # rank 2, float32: A and B
        assert [w.metrics.get("push_bytes") for w in wvs[1:]] == [adapter_bytes] * 2
