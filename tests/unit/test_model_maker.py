"""`make-model`: HF directories that Auto* classes load offline, for both architectures; the
byte-level tokenizer round-trips any text and its chat template is short; sizes and seeds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stream_rl.errors import ConfigError
from stream_rl.inference.model_maker import END, PRESETS, make_model, preset_parameters

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_directory_loads_with_auto_classes_and_tokenizer_round_trips(tmp_path: Path, arch: str) -> None:
    path = make_model(tmp_path / arch, "tiny", arch=arch)  # type: ignore[arg-type]
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert model.config.model_type == arch
    assert model.config.vocab_size == len(tokenizer) == 262
    for text in ["37+45=82", "Hello, world!\n\tx  y ", "héllo ✓ 日本"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("37+45=", add_special_tokens=False) == [6 + ord(c) for c in "37+45="]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "37+45="}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|user|>37+45=<|end|><|assistant|>"
    assert len(tokenizer.encode(prompt, add_special_tokens=False)) == 9  # 6 characters + 3 markers
    assert tokenizer.eos_token == END and model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.top_k == 0  # full-distribution sampling by default
    with torch.inference_mode():
        logits = model(torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])).logits
    assert logits.shape == (1, 9, 262)


def test_seed_decides_the_weights(tmp_path: Path) -> None:
    def weights(path: Path) -> torch.Tensor:
        return AutoModelForCausalLM.from_pretrained(path).model.layers[0].mlp.up_proj.weight

    a = weights(make_model(tmp_path / "a", seed=1))
    b = weights(make_model(tmp_path / "b", seed=1))
    c = weights(make_model(tmp_path / "c", seed=2))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_refuses_to_overwrite_and_unknown_presets(tmp_path: Path) -> None:
    make_model(tmp_path / "m")
    with pytest.raises(ConfigError, match="already holds"):
        make_model(tmp_path / "m")
    make_model(tmp_path / "m", overwrite=True)
    with pytest.raises(ConfigError, match="unknown preset"):
        make_model(tmp_path / "x", "huge")


@pytest.mark.parametrize(
    ("preset", "low", "high"),
    [("tiny", 0.4e6, 1.0e6), ("small", 3e6, 6e6), ("medium", 25e6, 40e6), ("large", 80e6, 130e6)],
)
def test_preset_sizes(preset: str, low: float, high: float) -> None:
    assert preset in PRESETS
    assert low <= preset_parameters(preset) <= high
