"""`trainer.lora`: the torch trainer training LoRA adapters only (peft), the base weights frozen.

- `wrap(model, cfg)` injects peft's LoRA layers into the targeted linear layers, in place; only
  their A and B require gradients, so `PolicyTrainer`'s optimizer (and its checkpointed state)
  covers the adapters only. peft initialises A at random (from the seeded torch RNG) and B at
  zero: version 0 is the base model exactly.
- `LoraTrainer.full_weights()` yields the merged weights under the base model's own names and
  order (`W0 + (alpha / r) * B @ A` through `stream_rl.weights.lora.merge`, the function the
  built-in server merges with): what the checksum covers and what a sender without adapter
  support pushes (vLLM, SGLang, CUDA IPC). The list carries the adapters (`MergedWeights.lora`):
  the built-in `WeightSender` pushes those instead (`POST /weights/update_lora`).
- Checkpoints: `model/` holds the adapter as peft saves it (`adapter_config.json`,
  `adapter_model.safetensors`; loadable with `PeftModel.from_pretrained(base, dir)`), beside the
  optimizer and schedule of the adapters. The base model is `model.path`, read again on resume.
- `trainer.lora.dropout` > 0: the adapters' dropout modules run in training mode (the rest of the
  model stays in eval mode), drawing from the seeded torch RNG, which checkpoints restore.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stream_rl.config import LoraConfig, TrainerConfig
from stream_rl.errors import ConfigError
from stream_rl.train.step import PolicyTrainer
from stream_rl.weights.lora import LoraTensors, MergedWeights, merge

ADAPTER_NAME = "default"
ADAPTER_CONFIG = "adapter_config.json"


def wrap(model: nn.Module, cfg: LoraConfig) -> Any:
    """The peft model around `model` (whose targeted layers are replaced in place). Raises
    `ConfigError` when a target matches no layer, or a layer that is not linear."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from peft.tuners.lora import Linear as LoraLinear

    peft_cfg = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,  # type: ignore[arg-type]  # annotated int; peft divides it by r as a float
        target_modules=list(cfg.target_modules),
        lora_dropout=cfg.dropout,
        bias="none",
    )
    try:
        with warnings.catch_warnings():  # peft asks transformers' deprecated is_gradient_checkpointing
            warnings.simplefilter("ignore", FutureWarning)
            peft_model = get_peft_model(model, peft_cfg)
    except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
        first = str(exc).strip().splitlines()[0]
        raise ConfigError(f"trainer.lora.target_modules: {first}") from exc
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in cfg.target_modules if t not in names]
    if missing:
        raise ConfigError(f"trainer.lora.target_modules: no layer named {', '.join(missing)} in the model")
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and not isinstance(module, LoraLinear):
            raise ConfigError(
                f"trainer.lora.target_modules: {name} is a {type(module).__name__}; only linear layers take adapters"
            )
    return peft_model


def _base_name(name: str) -> str | None:
    """The base model's name of a wrapped model's parameter (None: an adapter's own)."""
    if ".lora_" in name:
        return None
    return name.replace(".base_layer.", ".")


class LoraTrainer(PolicyTrainer):
    """`PolicyTrainer` of a model wrapped by `wrap`: adapters trained, merged weights served."""

    def __init__(self, peft_model: Any, cfg: TrainerConfig, **kwargs: Any) -> None:
        from peft.tuners.lora import Linear as LoraLinear

        self.peft_model = peft_model
        model = peft_model.get_base_model()  # the causal LM, its targeted layers replaced
        super().__init__(model, cfg, **kwargs)
        self.layers: dict[str, Any] = {
            f"{name}.weight": module
            for name, module in model.named_modules()
            if isinstance(module, LoraLinear)
        }
        if cfg.lora is not None and cfg.lora.dropout > 0:
            for module in self.layers.values():
                module.lora_dropout[ADAPTER_NAME].train()
        with self._base_weights() as named:
            from stream_rl.weights.checksum import weights_checksum

            self.base_checksum = weights_checksum(named)

    @contextmanager
    def _base_weights(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        out = []
        for name, p in self.model.named_parameters():
            base = _base_name(name)
            if base is not None:
                out.append((base, p.detach()))
        yield out

    def adapters(self) -> LoraTensors:
        """This version's adapter tensors (views of the trained parameters)."""
        pairs = []
        scale = 0.0
        for name, layer in self.layers.items():
            scale = float(layer.scaling[ADAPTER_NAME])
            pairs.append(
                (name, layer.lora_A[ADAPTER_NAME].weight.detach(), layer.lora_B[ADAPTER_NAME].weight.detach())
            )
        return LoraTensors(scale=scale, pairs=pairs, base_checksum=self.base_checksum)

    @contextmanager
    def full_weights(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The merged weights under the base model's names and order, the adapters attached."""
        lora = self.adapters()
        deltas = {name: (a, b) for name, a, b in lora.pairs}
        with self._base_weights() as base:
            merged = [
                (name, merge(w, *deltas[name], lora.scale) if name in deltas else w) for name, w in base
            ]
        yield MergedWeights(merged, lora)

    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.params)

    def save_to(self, directory: Path) -> None:
        """The adapter (peft's layout) in `model/`, the adapters' optimizer and schedule."""
        self.peft_model.save_pretrained(str(directory / "model"))
        torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")
        torch.save(self.scheduler.state_dict(), directory / "scheduler.pt")

    def save_merged(self, directory: Path, base_path: str | Path, dtype: str) -> None:
        """The merged weights as a plain Hugging Face model directory (`stream-rl export model` of a
        LoRA run): the base model read again from `base_path`, its weights set to the merged ones."""
        from stream_rl.common.modeling import load_causal_lm

        plain = load_causal_lm(base_path, dtype=dtype)
        params = dict(plain.named_parameters())
        with torch.no_grad(), self.full_weights() as named:
            for name, tensor in named:
                params[name].copy_(tensor)
        plain.save_pretrained(str(directory))

    def load_adapter(self, directory: Path) -> None:
        """Set the adapters to those saved in `directory` (a checkpoint's `model/`)."""
        from peft.utils import set_peft_model_state_dict
        from safetensors.torch import load_file

        state = load_file(str(directory / "adapter_model.safetensors"), device=str(self.device))
        result = set_peft_model_state_dict(self.peft_model, state, adapter_name=ADAPTER_NAME)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise ConfigError(
                f"{directory}: adapter tensors {', '.join(unexpected[:3])} do not fit trainer.lora "
                "(rank or target_modules changed since this checkpoint?)"
            )


def is_adapter(directory: Path) -> bool:
    """Whether `directory` holds a saved adapter (a LoRA checkpoint's `model/`)."""
    return (directory / ADAPTER_CONFIG).is_file()
