"""The engine on long sequences: in-flight swaps in the middle of a 300-token sequence under both
KV policies (spans exact, greedy tokens equal to transformers' with the old weights up to the
swap and the new ones after it), chunked prefill of long prompts, length-grouped recompute,
refusal of requests longer than the model, and the occupancy and KV-memory figures."""

from __future__ import annotations

import copy
from pathlib import Path

import httpx
import pytest
import torch
from fakes.server_thread import ServerThread, load_weights, random_weights
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from stream_rl.contracts.core import VersionSpan
from stream_rl.inference.engine import ContextLengthError, Engine
from stream_rl.inference.model_maker import make_model
from stream_rl.inference.requests import SamplingParams

pytestmark = pytest.mark.unit

PROMPT = [4, 57, 61, 49, 58, 59, 67, 1, 5]
LONG = 300  # completion tokens
SWAP_AT = 137  # decode steps before the swap


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return make_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="module")
def weights(model_dir: Path):  # type: ignore[no-untyped-def]
    """(old, new) random weights, both decoding varied text."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return random_weights(model, seed=11), random_weights(model, seed=12)


def model_with(model_dir: Path, named):  # type: ignore[no-untyped-def]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    load_weights(model, named)
    return model.eval()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def hf_greedy(model, prefix: list[int], new: int, past=None) -> list[int]:  # type: ignore[no-untyped-def]
    ids = torch.tensor([prefix])
    with torch.inference_mode():  # an explicit mask: sampled tokens may include the pad id
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=past,
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prefix) :].tolist()


@pytest.fixture(scope="module")
def reference(model_dir: Path, weights):  # type: ignore[no-untyped-def]
    """(old model, new model, the old weights' greedy tokens up to the swap, the new weights'
    greedy continuation of the prompt and those tokens), shared by both policies' tests."""
    old_model, new_model = model_with(model_dir, weights[0]), model_with(model_dir, weights[1])
    before = hf_greedy(old_model, PROMPT, SWAP_AT + 1)
    return old_model, new_model, before, hf_greedy(new_model, PROMPT + before, LONG - SWAP_AT - 1)


def swap_mid_sequence(model_dir: Path, weights, policy: str):  # type: ignore[no-untyped-def]
    """A 300-token greedy sequence with the weights swapped after SWAP_AT decode steps, beside a
    short request that finishes before the swap; returns the long sequence and its engine."""
    old, new = weights
    engine = Engine(
        model_with(model_dir, old),
        AutoTokenizer.from_pretrained(model_dir),
        max_batch=4,
        kv_policy=policy,  # type: ignore[arg-type]
    )
    future = engine.submit(PROMPT, greedy(LONG))
    short = engine.submit(PROMPT[:4], greedy(20))
    with torch.inference_mode():
        for _ in range(SWAP_AT):
            engine.step()
        assert short.done() and not future.done()
        swap = engine.swap_weights(1, {engine.parameters.canonical(n): t.clone() for n, t in new})
        while not future.done():
            engine.step()
    assert swap.result().version == 1
    return future.result().sequences[0], engine


def test_swap_in_a_long_sequence_keeps_the_old_kv(model_dir: Path, weights, reference) -> None:  # type: ignore[no-untyped-def]
    seq, _ = swap_mid_sequence(model_dir, weights, "keep")
    # Prefill sampled token 0, each of the SWAP_AT decode steps one more: the swap took effect
    # at token SWAP_AT + 1, exactly where the spans say.
    k = SWAP_AT + 1
    assert seq.version_spans == [VersionSpan(0, 0), VersionSpan(1, k)]
    assert len(seq.token_ids) == LONG and seq.finish_reason == "length"
    old_model, new_model, before, recomputed = reference
    assert seq.token_ids[:k] == before
    # Keep: positions before the swap hold the OLD weights' keys and values (the last old token
    # is fed, and cached, by the new weights); the new weights decode on top of that cache.
    cache = DynamicCache(config=old_model.config)
    with torch.inference_mode():
        old_model(torch.tensor([PROMPT + seq.token_ids[: k - 1]]), past_key_values=cache, use_cache=True)
    after = hf_greedy(new_model, PROMPT + seq.token_ids[:k], LONG - k, past=cache)
    assert seq.token_ids[k:] == after
    # ...which differs from what a recomputed cache would give: the policy is observable.
    assert seq.token_ids[k:] != recomputed


def test_swap_in_a_long_sequence_with_recompute(model_dir: Path, weights, reference) -> None:  # type: ignore[no-untyped-def]
    seq, engine = swap_mid_sequence(model_dir, weights, "recompute")
    k = SWAP_AT + 1
    assert seq.version_spans == [VersionSpan(0, 0), VersionSpan(1, k)]
    _, _, before, recomputed = reference
    assert seq.token_ids[:k] == before
    # Recompute: every token after the swap is the new weights' greedy continuation of the whole
    # prefix, as if the new weights had produced the cache.
    assert seq.token_ids[k:] == recomputed
    assert engine.version == 1


def test_recompute_groups_long_and_short_sequences_by_length(model_dir: Path, weights) -> None:  # type: ignore[no-untyped-def]
    """A recompute over sequences of very different lengths, with a prefill budget smaller than
    the longest one (chunked) and than their padded sum (several groups), stays exact."""
    old, new = weights
    engine = Engine(
        model_with(model_dir, old),
        AutoTokenizer.from_pretrained(model_dir),
        max_batch=4,
        kv_policy="recompute",
    )
    engine.batch.prefill_tokens = 96
    long = engine.submit(PROMPT, greedy(160))
    with torch.inference_mode():
        for _ in range(120):
            engine.step()
        shorts = [engine.submit(PROMPT[: 3 + i], greedy(30)) for i in range(3)]
        for _ in range(5):
            engine.step()
        lengths = sorted(s.cache_len for s in engine.batch.running)
        assert lengths[-1] > 96 and len(lengths) == 4
        engine.swap_weights(1, {engine.parameters.canonical(n): t.clone() for n, t in new})
        while not all(f.done() for f in [long, *shorts]):
            engine.step()
    new_model = model_with(model_dir, new)
    for prompt, future in [(PROMPT, long), *((PROMPT[: 3 + i], f) for i, f in enumerate(shorts))]:
        seq = future.result().sequences[0]
        k = seq.version_spans[1].start
        total = len(seq.token_ids)
        assert seq.token_ids[k:] == hf_greedy(new_model, prompt + seq.token_ids[:k], total - k)


def test_a_long_prompt_is_prefilled_in_chunks(model_dir: Path, weights) -> None:  # type: ignore[no-untyped-def]
    """A 300-token multi-turn context with a 64-token prefill budget: written in 5 chunks, the
    greedy continuation is transformers' (and so are the logprobs of its first token)."""
    model = model_with(model_dir, weights[0])
    reference = copy.deepcopy(model)
    engine = Engine(model, AutoTokenizer.from_pretrained(model_dir), max_batch=2)
    engine.batch.prefill_tokens = 64
    context = [(7 * i + 3) % 90 + 6 for i in range(300)]
    seq = engine.generate([context], greedy(24))[0].sequences[0]
    engine.stop()
    assert seq.token_ids == hf_greedy(reference, context, 24)
    with torch.inference_mode():
        logits = reference(torch.tensor([context])).logits[0, -1]
    assert seq.logprobs[0] == pytest.approx(torch.log_softmax(logits, -1).max().item(), abs=1e-4)


def test_a_request_longer_than_the_model_is_refused_with_a_400(model_dir: Path) -> None:
    engine = Engine.load(model_dir, max_batch=2)
    limit = engine.max_len
    with pytest.raises(ContextLengthError, match=f"at most max_tokens={limit - 10}"):
        engine.submit([7] * 10, greedy(limit))
    with ServerThread(engine) as server:
        over = httpx.post(
            f"{server.url}/v1/completions",
            json={"prompt": [7] * 10, "max_tokens": limit - 9},
            timeout=30,
        )
        assert over.status_code == 400
        error = over.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert f"maximum length of {limit}" in error["message"]
        assert f"max_tokens={limit - 10}" in error["message"]
        chat = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": limit},
            timeout=30,
        )
        assert chat.status_code == 400 and "maximum length" in chat.json()["error"]["message"]
        # Exactly at the limit fits; without max_tokens a chat completion may run to it.
        fits = httpx.post(
            f"{server.url}/v1/completions",
            json={"prompt": [7] * (limit - 2), "max_tokens": 2, "ignore_eos": True},
            timeout=30,
        )
        assert fits.status_code == 200 and len(fits.json()["choices"][0]["token_ids"]) == 2
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 200  # refusals do not touch the engine
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert f"stream_rl_inference_max_len {float(limit)}" in metrics
    assert "stream_rl_inference_kv_cache_max_bytes" in metrics


def test_occupancy_and_kv_memory_figures(model_dir: Path) -> None:
    engine = Engine.load(model_dir, max_batch=4)
    stats = engine.stats()
    assert stats.max_batch == 4 and stats.sequence_s == 0.0
    # tiny preset: 2 layers x (keys, values) x 4 slots x 2 KV heads x 32 dims x 4 bytes per position
    per_position = 2 * 2 * 4 * 2 * 32 * 4
    assert stats.kv_cache_bytes == per_position * 256
    assert stats.kv_cache_max_bytes == per_position * engine.max_len
    engine.generate([PROMPT] * 4, greedy(40))
    full = engine.stats()
    # four sequences decoding for (nearly) the whole busy time: occupancy close to 1
    assert 0.8 * 4 * full.busy_s < full.sequence_s <= 4 * full.busy_s
    engine.generate([PROMPT], greedy(40))
    one = engine.stats()
    assert one.sequence_s - full.sequence_s <= 1.0 * (one.busy_s - full.busy_s) + 1e-9
    engine.stop()
