"""SGLang 0.5.23 for real: our client and sender against a running SGLang server (GPU only; never
run in CI, UNVERIFIED until someone runs it).

Start SGLang on one GPU with the launcher's flags (docs/engines.md "SGLang"), the trainer on another:

    CUDA_VISIBLE_DEVICES=0 python -m sglang.launch_server --model-path Qwen/Qwen2.5-0.5B-Instruct \\
        --port 30000 --weight-version 0 --disable-radix-cache --disable-overlap-schedule \\
        --enable-deterministic-inference --random-seed 0
    STREAM_RL_SGLANG_URL=http://127.0.0.1:30000 STREAM_RL_ENGINE_MODEL=Qwen/Qwen2.5-0.5B-Instruct \\
        CUDA_VISIBLE_DEVICES=1 .venv/bin/pytest -m gpu tests/gpu/test_sglang.py

The pushed weights are the model's own (loaded with transformers), so the server's answers stay
sensible and greedy decoding is unchanged by an update.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from stream_rl.config import SamplingConfig
from stream_rl.contracts import VersionSpan
from stream_rl.inference.sglang_client import SGLangClient
from stream_rl.weights import ServerEndpoint
from stream_rl.weights.adapters.sglang import SGLangWeightSender

pytestmark = pytest.mark.gpu

MESSAGES = [{"role": "user", "content": "Count from 1 to 50, separated by spaces."}]


@pytest.fixture(scope="module")
def url() -> str:
    found = os.environ.get("STREAM_RL_SGLANG_URL")
    if not found or not torch.cuda.is_available() or not os.environ.get("STREAM_RL_ENGINE_MODEL"):
        pytest.skip("needs CUDA, STREAM_RL_SGLANG_URL and STREAM_RL_ENGINE_MODEL")
    return found


@pytest.fixture(scope="module")
def weights() -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(
        os.environ["STREAM_RL_ENGINE_MODEL"], dtype=torch.bfloat16
    )
    return [(n, p.detach().to("cuda")) for n, p in model.named_parameters()]


def complete(url: str, prompt: Any, sampling: SamplingConfig, n: int = 1, seed: int | None = None) -> Any:
    async def go() -> Any:
        async with SGLangClient(url) as client:
            return await client.complete_many(prompt, sampling, n=n, seed=seed), await client.version()

    return asyncio.run(go())


@pytest.mark.parametrize("pause", ["keep", "recompute", "drain"])
def test_pushes_label_every_token_with_the_version_that_sampled_it(
    url: str, weights: list[tuple[str, torch.Tensor]], pause: str
) -> None:
    greedy = SamplingConfig(temperature=0.0, max_tokens=16)
    with SGLangWeightSender([ServerEndpoint(url)], timeout_s=120.0, pause=pause) as sender:
        assert sender.connect() == {}
        before, _ = complete(url, MESSAGES, greedy)
        report = sender.push(11, weights, 64 << 20)
        assert report.updated == [url], report.failed
        assert report.per_server[url]["receive_ms"] > 0
        (after,), version = complete(url, MESSAGES, greedy)
        assert version == 11
        assert after.version_spans == [VersionSpan(11, 0)]
        assert after.token_ids == before[0].token_ids  # the same weights: the same greedy output
        # Token-id prompts go to /generate: one item per sample, each with its spans.
        samples, _ = complete(url, after.prompt_token_ids, SamplingConfig(max_tokens=8), n=3, seed=5)
        assert len(samples) == 3 and all(s.version_spans == [VersionSpan(11, 0)] for s in samples)
        assert all(len(s.logprobs) == len(s.token_ids) for s in samples)


def test_an_update_during_a_long_generation_splits_its_spans(
    url: str, weights: list[tuple[str, torch.Tensor]]
) -> None:
    long = SamplingConfig(temperature=0.0, max_tokens=400)
    with SGLangWeightSender([ServerEndpoint(url)], timeout_s=120.0) as sender:
        assert sender.connect() == {}
        sender.push(20, weights, 64 << 20)

        async def generate_while_pushing() -> Any:
            async with SGLangClient(url) as client:
                task = asyncio.create_task(client.complete(MESSAGES, long))
                await asyncio.sleep(0.5)
                await asyncio.to_thread(sender.push, 21, weights, 64 << 20)
                return await task

        completion = asyncio.run(generate_while_pushing())
    versions = [span.version for span in completion.version_spans]
    assert versions in ([20, 21], [21], [20]), completion.version_spans  # [20, 21] unless it was too quick
    assert completion.version_spans[0].start == 0


def test_seeds_reproduce_samples_and_differ_between_samples(url: str) -> None:
    sampling = SamplingConfig(temperature=1.0, max_tokens=12)
    first, _ = complete(url, MESSAGES, sampling, n=2, seed=123)
    again, _ = complete(url, MESSAGES, sampling, n=2, seed=123)
    # Reproducible only with --enable-deterministic-inference (the launcher passes it).
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert first[0].token_ids != first[1].token_ids


DYING = """
import sys, time, torch
from stream_rl.weights import ServerEndpoint
from stream_rl.weights.adapters.sglang import SGLangWeightSender
url = sys.argv[1]
sender = SGLangWeightSender([ServerEndpoint(url)], timeout_s=600.0)
assert sender.connect() == {}
server = ServerEndpoint(url)
sender._post(server, "/pause_generation", {"mode": "in_place"})
sender._post(server, "/begin_weight_update", {})
print("paused", flush=True)
time.sleep(3600)
"""


def test_a_trainer_killed_mid_update_leaves_a_server_the_next_trainer_recovers(
    url: str, weights: list[tuple[str, torch.Tensor]]
) -> None:
    dying = subprocess.Popen([sys.executable, "-c", DYING, url], stdout=subprocess.PIPE, text=True)
    try:
        assert dying.stdout is not None and dying.stdout.readline().strip() == "paused"
    finally:
        dying.send_signal(signal.SIGKILL)
        dying.wait()
    start = time.monotonic()
    with SGLangWeightSender([ServerEndpoint(url)], timeout_s=120.0) as sender:
        assert sender.connect() == {}  # ends the open session, labels it incomplete, continues
        assert sender.push(30, weights, 64 << 20).updated == [url]
    (completion,), version = complete(url, MESSAGES, SamplingConfig(temperature=0.0, max_tokens=4))
    assert version == 30 and completion.version_spans == [VersionSpan(30, 0)]
    assert time.monotonic() - start < 120
