"""The trainer on CUDA (GPU only; `bench/gpu_check.sh`): bf16 with an fp32 lm_head and fp32 master
weights against a float32 reference, gradient checkpointing, eager vs sdpa; and the colocated
one-GPU path end to end: a real `stream-rl serve --device cuda` process on the trainer's GPU,
`trainer.weight_transport: auto` choosing CUDA IPC, a training step, the push, and the server's
logprobs equal to the trainer's on the same tokens."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from cuda_helpers import REPO, cuda_or_skip, record
from pydantic import SecretStr

from stream_rl.config import TrainerConfig, load_config
from stream_rl.inference.model_maker import make_model
from stream_rl.train.push import make_sender
from stream_rl.train.step import PolicyTrainer, configure_determinism, load_model
from stream_rl.train.testing import make_sample

pytestmark = pytest.mark.gpu
TOKEN = "gpu-test"
# bf16 (fp32 head, fp32 masters) vs float32, one step at lr 1e-4, the `medium` preset (~30M):
LOGPROB_ATOL = 5e-2
LOSS_RTOL = 1e-2
GRAD_COSINE_MIN = 0.99


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cuda_or_skip()
    return make_model(tmp_path_factory.mktemp("m") / "medium", "medium", seed=0, tie_embeddings=False)


def batch(n: int = 16) -> list[Any]:
    rng = random.Random(0)
    return [
        make_sample(
            rng, key=f"g{i}", vocab_size=200, completion_len=(16, 64), advantage=1.0 if i % 2 else -1.0
        )
        for i in range(n)
    ]


def trainer(path: Path, dtype: str, attn: str = "sdpa", **cfg: Any) -> PolicyTrainer:
    configure_determinism(False, seed=0, threads=4)
    model = load_model(path, dtype, "cuda", attn)
    return PolicyTrainer(
        model, TrainerConfig(lr=1e-4, grad_clip=100.0, **cfg), temperature=1.0, device="cuda"
    )


def test_bf16_step_matches_float32_on_cuda(untied: Path) -> None:
    out = {}
    for dtype in ("float32", "bfloat16"):
        t = trainer(untied, dtype)
        logprobs = t.logprobs(batch())
        result = t.micro_batch(batch())
        grad = torch.cat([m.grad.flatten() for m in t.precision.masters if m.grad is not None])
        t.optimizer_step(16)
        out[dtype] = (logprobs, result.loss, grad, t)
    ref, bf = out["float32"], out["bfloat16"]
    lp_diff = float((ref[0] - bf[0]).abs().max())
    loss_rel = abs(ref[1] - bf[1]) / abs(ref[1])
    cosine = float(torch.nn.functional.cosine_similarity(ref[2], bf[2], dim=0))
    record(
        "bf16_vs_fp32", {"logprob_max_abs_diff": lp_diff, "loss_rel_diff": loss_rel, "grad_cosine": cosine}
    )
    assert lp_diff < LOGPROB_ATOL and loss_rel < LOSS_RTOL and cosine > GRAD_COSINE_MIN
    model: Any = bf[3].model
    assert (
        model.lm_head.weight.dtype == torch.float32
        and model.model.embed_tokens.weight.dtype == torch.bfloat16
    )


def test_gradient_checkpointing_and_attention_on_cuda(untied: Path) -> None:
    grads, peaks, logprobs = {}, {}, {}
    for attn, ckpt in (("sdpa", False), ("sdpa", True), ("eager", False)):
        t = trainer(untied, "float32", attn, gradient_checkpointing=ckpt)
        logprobs[attn] = t.logprobs(batch())
        torch.cuda.reset_peak_memory_stats()
        t.micro_batch(batch())
        peaks[(attn, ckpt)] = torch.cuda.max_memory_allocated()
        grads[(attn, ckpt)] = torch.cat([p.grad.flatten() for p in t.params if p.grad is not None])
    record("gradient_checkpointing_peak_mib", {str(k): v / 2**20 for k, v in peaks.items()})
    torch.testing.assert_close(grads[("sdpa", True)], grads[("sdpa", False)], atol=1e-5, rtol=1e-4)
    assert peaks[("sdpa", True)] < peaks[("sdpa", False)]
    torch.testing.assert_close(logprobs["eager"], logprobs["sdpa"], atol=1e-4, rtol=0)


@pytest.fixture
def cuda_server(untied: Path, tmp_path: Path) -> Iterator[str]:
    port_file = tmp_path / "port"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [
        sys.executable, "-m", "stream_rl.cli", "serve", "--model", str(untied), "--dtype", "bfloat16",
        "--device", "cuda", "--port", "0", "--port-file", str(port_file), "--admin-token", TOKEN,
        "--max-batch", "8", "--seed", "0",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"the CUDA server did not start: {proc.stderr.read() if proc.stderr else ''}"
                )
            time.sleep(0.2)
        url = f"http://127.0.0.1:{port_file.read_text().strip()}"
        while httpx.get(f"{url}/health").status_code != 200:
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)


def test_colocated_one_gpu_trains_and_pushes_over_cuda_ipc(untied: Path, cuda_server: str) -> None:
    config = load_config(
        None,
        [
            f"inference.servers=[{{url: '{cuda_server}'}}]",
            "inference.device=cuda",
            "trainer.device=cuda",
            "model.dtype=bfloat16",
            f"model.path={untied}",
            "trainer.update_timeout_s=30",
        ],
    )
    config.inference.admin_token = SecretStr(TOKEN)
    t = trainer(untied, "bfloat16")
    sender: Any = make_sender(config)
    try:
        assert sender.connect() == {}
        assert sender.transport == {cuda_server: "cuda_ipc"}  # auto: the server is on this GPU
        with t.full_weights() as named:
            first = sender.push(0, named, 16 << 20)
        t.micro_batch(batch())
        t.optimizer_step(16)
        with t.full_weights() as named:
            assert dict(named)["lm_head.weight"].dtype == torch.float32
            second = sender.push(1, named, 16 << 20)
    finally:
        sender.close()
    assert first.updated == [cuda_server] and second.updated == [cuda_server] and not second.failed
    per = second.per_server[cuda_server]
    record("colocated_push", {k: round(v, 2) for k, v in per.items()})
    headers = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.get(f"{cuda_server}/weights/version", headers=headers).json()["version"] == 1
    prompt = [5, 9, 13, 2, 40, 41]
    body = {
        "prompt": prompt,
        "max_tokens": 24,
        "temperature": 1.0,
        "seed": 3,
        "logprobs": 0,
        "ignore_eos": True,
    }
    choice = httpx.post(f"{cuda_server}/v1/completions", json=body, timeout=60).json()["choices"][0]
    tokens, served = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    with torch.no_grad():
        ids = torch.tensor([prompt + tokens], device="cuda")
        logits = t.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        ours = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
    diff = float((ours.cpu() - torch.tensor(served)).abs().max())
    record("colocated_logprob_max_abs_diff", diff)
    assert diff < LOGPROB_ATOL  # the server decodes with the weights the trainer just trained
