"""A trainer written from docs/weights-protocol.md alone (httpx and torch.distributed; none of
stream_rl.weights): it joins, pushes random weights while a long generation decodes, and the
server's greedy output then equals transformers' with those weights."""

from __future__ import annotations

import concurrent.futures as cf
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist
from fakes.server_thread import ServerThread
from transformers import AutoModelForCausalLM

from stream_rl.inference.engine import Engine
from stream_rl.inference.model_maker import make_model

pytestmark = pytest.mark.integration

TOKEN = "outside-token"
PROMPT = [4, 57, 61, 49, 58, 59, 67, 1, 5]
DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def buckets(metas: list[dict], bucket_bytes: int) -> list[list[dict]]:  # type: ignore[type-arg]
    """Section 3.1 of the doc."""
    out: list[list[dict]] = []  # type: ignore[type-arg]
    current: list[dict] = []  # type: ignore[type-arg]
    size = 0
    for m in metas:
        n = DTYPE[m["dtype"]].itemsize
        for d in m["shape"]:
            n *= d
        if n > bucket_bytes:
            if current:
                out.append(current)
                current, size = [], 0
            out.append([m])
            continue
        if current and size + n > bucket_bytes:
            out.append(current)
            current, size = [], 0
        current.append(m)
        size += n
    if current:
        out.append(current)
    return out


def test_an_outside_trainer_following_the_doc_updates_weights_in_flight(tmp_path: Path) -> None:
    model_dir = make_model(tmp_path / "tiny", "tiny", seed=0)
    engine = Engine.load(model_dir, max_batch=8, seed=0)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with ServerThread(engine, admin_token=TOKEN) as server, cf.ThreadPoolExecutor(3) as pool:
        http = httpx.Client(base_url=server.url, headers=auth, timeout=60)
        metas = http.get("/weights/meta").json()
        # Section 2: store, init_group in the background, the group on the raw store, handshake.
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

        # Random new weights, and the same in a transformers model for reference.
        reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        gen = torch.Generator().manual_seed(3)
        new = {}
        for m in metas:
            noise = torch.randn(m["shape"], generator=gen)
            new[m["name"]] = (1 + 0.1 * noise if "norm" in m["name"] else 0.2 * noise).to(DTYPE[m["dtype"]])
        params = dict(reference.named_parameters())
        with torch.no_grad():
            for name, t in new.items():
                params[name].copy_(t)

        # A long generation is decoding while the update arrives.
        long_body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "temperature": 0}
        long_call = pool.submit(httpx.post, f"{server.url}/v1/completions", json=long_body, timeout=120)
        while engine.stats().generated_tokens < 20:
            pass
        # Section 3: the update request in the background, then one broadcast per bucket.
        update = {"version": 7, "tensors": metas, "bucket_bytes": 32 * 1024}
        reply = pool.submit(http.post, "/weights/update", json=update)  # answers after the buckets
        for bucket in buckets(metas, update["bucket_bytes"]):
            raw = torch.cat([new[m["name"]].contiguous().reshape(-1).view(torch.uint8) for m in bucket])
            if raw.numel():
                pg.broadcast([raw], bopts).wait()
        result = reply.result()
        assert result.status_code == 200, result.text
        assert result.json()["version"] == 7
        spans = long_call.result().json()["choices"][0]["version_spans"]
        assert [s["version"] for s in spans] == [0, 7]  # the update landed mid-sequence
        greedy = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        choice = httpx.post(f"{server.url}/v1/completions", json=greedy, timeout=60).json()["choices"][0]

        # Section 4: an update of one tensor (the others keep theirs), then one of none (a relabel).
        norm = next(m for m in metas if m["name"] == "model.norm.weight")
        new_norm = torch.full(norm["shape"], 1.5, dtype=DTYPE[norm["dtype"]])
        partial = {"version": 8, "tensors": [norm], "bucket_bytes": 1024}
        reply = pool.submit(http.post, "/weights/update", json=partial)
        pg.broadcast([new_norm.reshape(-1).view(torch.uint8)], bopts).wait()
        assert reply.result().json()["version"] == 8
        empty = http.post("/weights/update", json={"version": 9, "tensors": [], "bucket_bytes": 1024})
        assert empty.status_code == 200 and empty.json()["version"] == 9, empty.text
        assert http.get("/weights/version").json() == {"version": 9}
        assert torch.equal(engine.parameters.get("model.norm.weight"), new_norm)
        embed = "model.embed_tokens.weight"
        assert torch.equal(engine.parameters.get(embed), new[embed])
    with torch.inference_mode():
        out = reference.generate(
            torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert choice["token_ids"] == out[0, len(PROMPT) :].tolist()
    assert choice["version_spans"] == [{"version": 7, "start": 0}]
