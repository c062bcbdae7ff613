"""bf16 training with float32 master weights and a float32 lm_head (CPU), and the config checks of
the precision, attention and weight-transport options."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from stream_rl.config import TrainerConfig, load_config
from stream_rl.errors import ConfigError
from stream_rl.train.step import MASTER_WEIGHTS_FILE, PolicyTrainer, configure_determinism, load_model
from stream_rl.train.testing import make_sample, make_tiny_model

pytestmark = pytest.mark.unit

# One step of the bf16 model (fp32 head, fp32 masters) against the same step in float32, tiny
# model, lr 1e-3: the tolerances the bf16 path is held to (measured: 2.4e-3, 1.1e-4, 0.99999).
LOGPROB_ATOL = 1e-2
LOSS_RTOL = 2e-3
GRAD_COSINE_MIN = 0.999


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("m") / "untied", tie_embeddings=False)


def batch(n: int = 8) -> list[Any]:
    rng = random.Random(0)
    return [make_sample(rng, key=f"g{i}", advantage=1.0 if i % 2 else -1.0) for i in range(n)]


def trainer(path: Path, dtype: str, lr: float = 1e-3) -> PolicyTrainer:
    configure_determinism(True, seed=0, threads=1)
    return PolicyTrainer(
        load_model(path, dtype, "cpu"), TrainerConfig(lr=lr, grad_clip=100.0), temperature=1.0
    )


def test_a_bf16_step_matches_the_float32_step(untied: Path) -> None:
    lr = 1e-3
    out = {}
    for dtype in ("float32", "bfloat16"):
        t = trainer(untied, dtype, lr)
        logprobs = t.logprobs(batch())
        result = t.micro_batch(batch())
        grad = torch.cat([m.grad.flatten() for m in t.precision.masters if m.grad is not None])
        assert grad.dtype == torch.float32  # accumulated in float32 whatever the model's dtype
        t.optimizer_step(8)
        weights = torch.cat([m.detach().flatten() for m in t.precision.masters])
        out[dtype] = (logprobs, result.loss, grad, weights, t)
    ref, bf = out["float32"], out["bfloat16"]
    assert (ref[0] - bf[0]).abs().max() < LOGPROB_ATOL
    assert abs(ref[1] - bf[1]) <= LOSS_RTOL * abs(ref[1])
    assert torch.nn.functional.cosine_similarity(ref[2], bf[2], dim=0) > GRAD_COSINE_MIN
    # AdamW's first step moves each weight by ~lr; a gradient whose sign differs moves it the other way
    assert (ref[3] - bf[3]).abs().max() <= 2.5 * lr
    model = bf[4].model
    assert model.lm_head.weight.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_updates_below_bf16_resolution_accumulate_in_the_masters(untied: Path) -> None:
    t = trainer(untied, "bfloat16", lr=1e-6)
    assert t.precision.mixed
    params = dict(t.model.named_parameters())
    before = {n: p.detach().float().clone() for n, p in params.items()}
    for _ in range(3):
        t.micro_batch(batch(4))
        t.optimizer_step(4)
    for (name, p), m in zip(params.items(), t.precision.masters, strict=True):
        if p.dtype == torch.bfloat16:
            assert torch.equal(p.detach(), m.detach().to(torch.bfloat16)), name  # params = rounded masters
    embed = t.precision.masters[0]
    moved = (embed.detach() - before["model.embed_tokens.weight"]).abs()
    assert moved.max() > 2e-6  # three steps of ~1e-6 each, kept in float32...
    rounded = params["model.embed_tokens.weight"].detach().float() - before["model.embed_tokens.weight"]
    assert (rounded != 0).float().mean() < (moved != 0).float().mean()  # ...most of which bf16 drops


def test_master_weights_round_trip_through_a_checkpoint(untied: Path, tmp_path: Path) -> None:
    t = trainer(untied, "bfloat16", lr=1e-6)
    t.micro_batch(batch(4))
    t.optimizer_step(4)
    t.save_to(tmp_path)
    assert (tmp_path / MASTER_WEIGHTS_FILE).is_file()
    resumed = PolicyTrainer(
        load_model(tmp_path / "model", "bfloat16", "cpu"), TrainerConfig(lr=1e-6), temperature=1.0
    )
    resumed.load_from(tmp_path)
    for a, b in zip(t.precision.masters, resumed.precision.masters, strict=True):
        assert torch.equal(a.detach(), b.detach())
    float32 = trainer(untied, "float32")
    float32.save_to(tmp_path / "f32")
    assert not (tmp_path / "f32" / MASTER_WEIGHTS_FILE).exists()  # float32 params are their own masters


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.dtype=float16"], "model.dtype: float16 is not trained by trainer.backend: torch"),
        (["trainer.weight_transport=nccl"], "trainer.weight_transport: nccl needs trainer.device: cuda"),
        (
            ["trainer.weight_transport=cuda_ipc"],
            "trainer.weight_transport: cuda_ipc needs trainer.device: cuda",
        ),
        (
            ["trainer.weight_transport=cuda_ipc", "trainer.device=cuda"],
            "cuda_ipc needs inference.device: cuda",
        ),
        (
            ["trainer.weight_transport=gloo", "inference.engine=vllm"],
            "trainer.weight_transport applies to built-in servers only",
        ),
        (["model.attn_implementation=flash_attention_2"], "flash_attention_2 needs the flash-attn package"),
        (["model.attn_implementation=flash"], "model.attn_implementation"),
    ],
)
def test_options_that_cannot_work_are_refused_in_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_options_load_where_they_can_run() -> None:
    config = load_config(
        None,
        [
            "model.dtype=bfloat16",
            "model.attn_implementation=eager",
            "trainer.gradient_checkpointing=true",
            "trainer.weight_transport=gloo",
        ],
    )
    assert config.model.attn_implementation == "eager" and config.trainer.gradient_checkpointing
    cuda = load_config(
        None, ["trainer.device=cuda", "inference.device=cuda", "trainer.weight_transport=cuda_ipc"]
    )
    assert cuda.trainer.weight_transport == "cuda_ipc"
