"""vLLM and SGLang adapters against running engines (GPU only; never run in CI, unverified).

Start the engine on its own GPU(s), then point the test at it, the trainer on another GPU:

    VLLM_SERVER_DEV_MODE=1 vllm serve Qwen/Qwen2.5-0.5B-Instruct --weight-transfer-config '{"backend": "nccl"}'
    STREAM_RL_VLLM_URL=http://127.0.0.1:8000 STREAM_RL_ENGINE_MODEL=Qwen/Qwen2.5-0.5B-Instruct \\
        CUDA_VISIBLE_DEVICES=1 .venv/bin/pytest -m gpu tests/gpu/test_engine_adapters.py

    python -m sglang.launch_server --model-path Qwen/Qwen2.5-0.5B-Instruct --port 30000 \\
        --weight-version 0 --disable-radix-cache --disable-overlap-schedule
    STREAM_RL_SGLANG_URL=http://127.0.0.1:30000 STREAM_RL_ENGINE_MODEL=... (same command)

(SGLang's labels, pause policies and recovery: tests/gpu/test_sglang.py.)

The trainer's weights are the model's own, loaded with transformers (so generation stays
sensible); the test pushes them twice and checks the reports and that the server still answers.
"""

from __future__ import annotations

import os
from typing import Any

import httpx
import pytest
import torch

from stream_rl.weights import ServerEndpoint

pytestmark = pytest.mark.gpu


def _model_weights() -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    name = os.environ.get("STREAM_RL_ENGINE_MODEL")
    if not name:
        pytest.skip("set STREAM_RL_ENGINE_MODEL to the served model")
    model: Any = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16)
    model = model.to("cuda")
    return [(n, p.detach()) for n, p in model.named_parameters()]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_adapter_pushes_weights_to_a_running_engine(engine: str) -> None:
    url = os.environ.get(f"STREAM_RL_{engine.upper()}_URL")
    if not url or not torch.cuda.is_available():
        pytest.skip(f"needs CUDA and STREAM_RL_{engine.upper()}_URL")
    if engine == "vllm":
        from stream_rl.weights.adapters.vllm import VLLMWeightSender as Sender
    else:
        from stream_rl.weights.adapters.sglang import SGLangWeightSender as Sender  # type: ignore[assignment]
    weights = _model_weights()
    with Sender([ServerEndpoint(url)], master_addr="127.0.0.1") as sender:
        assert sender.connect() == {}
        first = sender.push(1, weights, 64 << 20)
        assert first.updated == [url] and first.failed == {}
        assert first.per_server[url]["receive_ms"] > 0
        second = sender.push(2, weights, 64 << 20)
        assert second.updated == [url]
    answer = httpx.post(
        f"{url}/v1/completions",
        json={"model": os.environ["STREAM_RL_ENGINE_MODEL"], "prompt": "1+1=", "max_tokens": 4},
        timeout=60,
    )
    assert answer.status_code == 200
