"""Tiny models built from a config: `stream-rl make-model --preset tiny --out models/tiny`.

Writes a Hugging Face directory that `AutoModelForCausalLM.from_pretrained(DIR)` and
`AutoTokenizer.from_pretrained(DIR)` load with no hub access: a randomly initialised Qwen2 (or
Llama) causal LM and a byte-level tokenizer built with `tokenizers`.

The tokenizer has one token per byte (so ASCII text is one token per character and any text
round-trips) plus six special tokens: ids 0-5 are the specials, id 6 + b is byte b. It is a
byte-level BPE without merges, the layout transformers' own Qwen2 tokenizer class rebuilds on
load, so `AutoTokenizer` gives the same ids for both architectures. Its chat template is
deliberately short (every prompt token costs on CPU):

    <|system|>...<|end|><|user|>37+45=<|end|><|assistant|>

and the assistant answers `82<|end|>`: `<|end|>` ends a turn and is the eos token. `<|pad|>` pads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from stream_rl.errors import ConfigError

PAD, END, UNK = "<|pad|>", "<|end|>", "<|unk|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, END, UNK, *ROLE_TOKENS)


def byte_symbols() -> list[str]:
    """The printable stand-in of each byte 0..255 used by byte-level BPE (GPT-2's mapping)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols: dict[int, str] = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)

Arch = Literal["qwen2", "llama"]


@dataclass(frozen=True)
class Preset:
    """Shape of a preset model (parameter counts are for the character vocabulary)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int = 2048


PRESETS: dict[str, Preset] = {
    # ~0.5M parameters: the CPU demo's model (measurements.md: 128 hidden x 2 layers).
    "tiny": Preset(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512),
    # ~4M
    "small": Preset(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=1024),
    # ~30M
    "medium": Preset(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=2048),
    # ~100M
    "large": Preset(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, intermediate_size=3072),
}


def build_tokenizer() -> Any:
    """The byte-level tokenizer (a `PreTrainedTokenizerFast`) with its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *byte_symbols()])}
    # BPE without merges over byte symbols: one token per byte.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=END,
        unk_token=UNK,
        additional_special_tokens=list(ROLE_TOKENS),
        clean_up_tokenization_spaces=False,
        model_max_length=max(p.max_position_embeddings for p in PRESETS.values()),
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _model_config(
    preset: Preset, arch: Arch, vocab_size: int, pad_id: int, eos_id: int, tie: bool = True
) -> Any:
    from transformers import LlamaConfig, Qwen2Config

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        max_position_embeddings=preset.max_position_embeddings,
        tie_word_embeddings=tie,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
    )
    if arch == "qwen2":
        return Qwen2Config(**common)
    return LlamaConfig(**common)


def make_model(
    out: str | Path,
    preset: str = "tiny",
    *,
    seed: int = 0,
    arch: Arch = "qwen2",
    overwrite: bool = False,
    tie_embeddings: bool = True,
) -> Path:
    """Write a randomly initialised model and its tokenizer to `out`; returns the directory.

    `tie_embeddings=False` gives the lm_head its own weight (as most models past ~1B have), the
    case where a bf16 model keeps its lm_head in float32 (stream_rl.common.modeling).

    The same (preset, arch, seed) always gives bit-identical weights. Refuses to overwrite a
    directory that already holds a model unless `overwrite`.
    """
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if arch not in ("qwen2", "llama"):
        raise ConfigError(f"unknown arch {arch!r}; choose qwen2 or llama")
    out = Path(out)
    if (out / "config.json").exists() and not overwrite:
        raise ConfigError(f"{out} already holds a model (pass --overwrite to replace it)")
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = build_tokenizer()
    config = _model_config(
        PRESETS[preset], arch, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, tie_embeddings
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Full-distribution sampling by default: RL's trainer assumes softmax(logits / T) with no
    # top-k (transformers would otherwise sample with top_k=50).
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def preset_parameters(preset: str, arch: Arch = "qwen2") -> int:
    """Parameter count of a preset (tied weights once), computed without allocating it."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer()
    config = _model_config(
        PRESETS[preset], arch, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def count_parameters(path: str | Path) -> int:
    """Number of distinct parameters of the model in `path` (tied weights counted once)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    return sum(p.numel() for p in model.parameters())
