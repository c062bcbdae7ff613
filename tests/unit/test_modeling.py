"""Loading for trainer and engine (stream_rl.common.modeling): the fp32-lm_head precision rule, the
attention implementation, gradient checkpointing in eval mode. CPU, tiny random models."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from fakes.training import make_sample, make_tiny_model

from stream_rl.common.modeling import enable_gradient_checkpointing, untied_head_name
from stream_rl.config import TrainerConfig
from stream_rl.errors import ConfigError, InferenceError
from stream_rl.inference.engine import Engine
from stream_rl.inference.model_maker import make_model
from stream_rl.inference.requests import SamplingParams
from stream_rl.train.rows import pack_samples
from stream_rl.train.step import PolicyTrainer, completion_logits, configure_determinism, load_model

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("m") / "untied", tie_embeddings=False)


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tied")


def samples(n: int = 4, seed: int = 0) -> list[Any]:
    rng = random.Random(seed)
    return [make_sample(rng, key=f"g{i}", advantage=1.0 if i % 2 else -1.0) for i in range(n)]


def dtypes(model: Any) -> dict[str, torch.dtype]:
    return {name: p.dtype for name, p in model.named_parameters()}


def test_bf16_keeps_an_untied_head_in_float32_and_computes_float32_logits(untied: Path) -> None:
    model: Any = load_model(untied, "bfloat16", "cpu")
    kinds = dtypes(model)
    assert kinds.pop("lm_head.weight") == torch.float32
    assert set(kinds.values()) == {torch.bfloat16}
    assert untied_head_name(model) == "lm_head.weight"
    logits = completion_logits(model, pack_samples(samples(2), 64), torch.device("cpu"))
    assert logits.dtype == torch.float32
    full = model(input_ids=torch.tensor([[1, 2, 3]])).logits  # the HF forward goes through the hook too
    assert full.dtype == torch.float32


def test_a_tied_head_stays_in_the_model_dtype(tied: Path) -> None:
    model: Any = load_model(tied, "bfloat16", "cpu")
    assert set(dtypes(model).values()) == {torch.bfloat16}
    assert untied_head_name(model) is None
    assert set(dtypes(load_model(tied, "float32", "cpu")).values()) == {torch.float32}


def test_engine_holds_what_the_trainer_pushes_and_greedy_matches_transformers(untied: Path) -> None:
    trainer_model: Any = load_model(untied, "bfloat16", "cpu")
    engine = Engine.load(untied, dtype="bfloat16", max_batch=4, seed=0)
    specs = {s.name: s.dtype for s in engine.parameters.specs()}
    assert specs == {n: str(t).removeprefix("torch.") for n, t in dtypes(trainer_model).items()}
    assert specs["lm_head.weight"] == "float32"
    prompt = [5, 9, 13, 2]
    got = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.stop()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        want = []
        for _ in range(8):  # greedy by hand with the same fp32-head model
            nxt = int(trainer_model(input_ids=ids).logits[0, -1].argmax())
            want.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    assert got[0].sequences[0].token_ids == want


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eager_and_sdpa_give_the_same_packed_logprobs(untied: Path, dtype: str) -> None:
    cfg = TrainerConfig(lr=1e-3)
    batch = samples(6)
    out = {}
    for attn in ("eager", "sdpa"):
        model = load_model(untied, dtype, "cpu", attn)
        assert model.config._attn_implementation == attn
        out[attn] = PolicyTrainer(model, cfg, temperature=1.0).logprobs(batch)
    tol = 1e-5 if dtype == "float32" else 2e-2
    torch.testing.assert_close(out["eager"], out["sdpa"], atol=tol, rtol=0)


def test_engine_eager_matches_sdpa_greedy(tmp_path: Path) -> None:
    path = make_model(tmp_path / "m", "tiny", seed=1)
    prompts = [[5, 9, 13, 2], [7, 7, 30], [40, 41, 42, 43, 44, 45]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for attn in ("eager", "sdpa"):
        engine = Engine.load(path, attn_implementation=attn, max_batch=4, seed=0)
        assert engine.model.config._attn_implementation == attn
        tokens[attn] = [r.sequences[0].token_ids for r in engine.generate(prompts, params)]
        engine.stop()
    assert tokens["eager"] == tokens["sdpa"]


def test_flash_attention_2_is_refused_in_one_line_when_it_cannot_run(untied: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_model(untied, "bfloat16", "cpu", "flash_attention_2")
    assert "\n" not in str(err.value) and "flash_attention_2" in str(err.value)
    with pytest.raises(InferenceError, match="flash_attention_2"):
        Engine.load(untied, dtype="bfloat16", attn_implementation="flash_attention_2")


def test_gradient_checkpointing_recomputes_layers_and_gives_the_same_gradients(untied: Path) -> None:
    configure_determinism(True, seed=0, threads=1)
    batch = samples(4)
    grads, calls = {}, {}
    for on in (False, True):
        model: Any = load_model(untied, "float32", "cpu")
        trainer = PolicyTrainer(model, TrainerConfig(lr=1e-3, gradient_checkpointing=on), temperature=1.0)
        layer = model.model.layers[0]
        count: list[int] = [0]
        # a pre-hook of the layer's first submodule: transformers checkpoints the layer's forward
        # (inside the layer's own hooks), and the recompute stops once it has what backward needs
        layer.input_layernorm.register_forward_pre_hook(lambda *_, c=count: c.__setitem__(0, c[0] + 1))
        trainer.micro_batch(batch)
        calls[on] = count[0]
        grads[on] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        # dropout-bearing submodules stay in eval mode: only the layers are flagged
        assert not layer.self_attn.training and not model.training
        assert layer.training is on
    assert calls == {False: 1, True: 2}  # the forward ran again in the backward pass
    assert grads[True].keys() == grads[False].keys()
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, atol=1e-6, rtol=1e-5)


def test_gradient_checkpointing_is_refused_for_a_model_without_support() -> None:
    with pytest.raises(ConfigError, match="does not support"):
        enable_gradient_checkpointing(torch.nn.Linear(2, 2))
