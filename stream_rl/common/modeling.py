"""Loading a causal LM the same way in the trainer and the built-in engine: dtype, fp32 lm_head,
attention implementation, gradient checkpointing.

Precision rule (PipelineRL's, `finetune/checkpoints.apply_fp32_lm_head`): with `model.dtype`
bfloat16 or float16, an **untied** `lm_head` is kept in float32 and the last hidden state is cast
to float32 in front of it, so logits and logprobs are computed in float32; every other parameter
has `model.dtype`. A tied head shares the embedding's tensor and keeps `model.dtype`. The trainer
and the built-in engine both load through `load_causal_lm`, so the tensors the trainer pushes
(bf16 body, fp32 head) have exactly the dtypes the server holds (`GET /weights/meta`); the sender
checks that before it sends a byte.

Attention: `model.attn_implementation` (`eager`, `sdpa`, `flash_attention_2`) is passed to
`from_pretrained`; `flash_attention_2` needs the `flash_attn` package and CUDA, and is refused
with a one-line error otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from stream_rl.common.dtypes import DTYPES
from stream_rl.errors import ConfigError

AttnImplementation = Literal["eager", "sdpa", "flash_attention_2"]
ATTN_IMPLEMENTATIONS: tuple[AttnImplementation, ...] = ("eager", "sdpa", "flash_attention_2")


def check_attn_implementation(name: str, device: str, dtype: str) -> None:
    """Raise `ConfigError` (one line) when `name` cannot run here."""
    from stream_rl.config import flash_attention_problem

    if name not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(
            f"model.attn_implementation must be one of {', '.join(ATTN_IMPLEMENTATIONS)}, got {name!r}"
        )
    if name == "flash_attention_2":
        problem = flash_attention_problem(dtype, [torch.device(device).type])
        if problem:
            raise ConfigError(problem)


def _cast_to_head_dtype(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    weight: torch.Tensor = module.weight  # type: ignore[assignment]
    return (args[0].to(weight.dtype), *args[1:])


def keep_lm_head_fp32(model: Any) -> bool:
    """Make an untied lm_head float32 (and cast its input) when the body is bf16/fp16.

    Returns True when it did. Idempotent: the cast hook is registered once.
    """
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    if head is None or embed is None or head.weight is embed.weight:
        return False  # tied (or no head): the head is the embedding, in model.dtype
    if embed.weight.dtype not in (torch.bfloat16, torch.float16):
        return False
    head.to(torch.float32)
    if not getattr(head, "_stream_rl_fp32_hook", False):
        head.register_forward_pre_hook(_cast_to_head_dtype)
        head._stream_rl_fp32_hook = True
    return True


def untied_head_name(model: Any) -> str | None:
    """The parameter name of an untied lm_head's weight (None when tied or absent)."""
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    if head is None or embed is None or head.weight is embed.weight:
        return None
    return next((name for name, p in model.named_parameters() if p is head.weight), None)


def load_causal_lm(
    path: str | Path,
    *,
    dtype: str,
    attn_implementation: str = "sdpa",
    device: str = "cpu",
    runs_in: str | None = None,
) -> Any:
    """The causal LM in the local directory `path` on `device`, in `dtype` with the precision rule
    above and the attention implementation asked for (no hub access). `runs_in`: the dtype it will
    run in when a wrapper casts it later (DeepSpeed), for the attention check."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if dtype not in DTYPES:
        raise ConfigError(f"model.dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    check_attn_implementation(attn_implementation, device, runs_in or dtype)
    model: Any = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=DTYPES[dtype], attn_implementation=attn_implementation, local_files_only=True
    )
    if keep_lm_head_fp32(model):
        _reload_fp32_head(model, Path(path))
    model.to(torch.device(device))
    return model


def _reload_fp32_head(model: Any, path: Path) -> None:
    """Our own checkpoints store the fp32 head in float32, and `from_pretrained(dtype=bf16)` has
    just rounded it: read it again, exactly (a head saved in bf16 is left as loaded)."""
    import json

    from safetensors import safe_open

    name = untied_head_name(model)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shard = json.loads(index.read_text()).get("weight_map", {}).get(name)
        file = path / shard if shard else None
    else:
        file = path / "model.safetensors"
    if name is None or file is None or not file.is_file():
        return
    with safe_open(str(file), framework="pt") as f:
        if name not in f.keys():  # noqa: SIM118 (safe_open has keys(), not __contains__)
            return
        saved = f.get_tensor(name)
    if saved.dtype == torch.float32 and tuple(saved.shape) == tuple(
        model.get_output_embeddings().weight.shape
    ):
        with torch.no_grad():
            model.get_output_embeddings().weight.copy_(saved)


def enable_gradient_checkpointing(model: Any) -> int:
    """Recompute each decoder layer's activations in the backward pass (non-reentrant
    `torch.utils.checkpoint`, transformers' own per-layer wrapper); returns the layers wrapped.

    The trainer runs its model in eval mode (no dropout, so recomputed logprobs equal the
    sampler's), and transformers checkpoints a layer only while that layer is in training mode:
    only the checkpointed layers themselves are flagged `training` (their attention and MLP
    submodules stay in eval mode, so dropout stays off). Raises `ConfigError` for a model without
    gradient checkpointing support.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(
            f"trainer.gradient_checkpointing: {type(model).__name__} does not support gradient checkpointing"
        )
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)  # the name since transformers 5.2x
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    layers = [
        m
        for m in model.modules()
        if isinstance(m, GradientCheckpointingLayer) and getattr(m, "gradient_checkpointing", False)
    ]
    if not layers:
        raise ConfigError(
            f"trainer.gradient_checkpointing: {type(model).__name__} has no checkpointable layers"
        )
    for layer in layers:
        layer.training = True  # not .train(): that would switch dropout on in the submodules
    return len(layers)
