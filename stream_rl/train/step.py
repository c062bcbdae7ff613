"""The model step of the trainer: micro-batch forward/backward and one AdamW step.

Contract:
- `PolicyTrainer.micro_batch(samples)` packs the samples (`stream_rl.train.packing`), recomputes
  the completion tokens' logprobs at the sampling temperature (`log_softmax(logits / T)` at the
  next-token labels; the LM head runs on completion positions only), and back-propagates the
  *summed* policy loss (`stream_rl.rl.losses.policy_loss` with `num_sequences=1`). Gradients
  accumulate across micro-batches.
- `PolicyTrainer.optimizer_step(num_sequences)` divides the accumulated gradients by the number
  of sequences trained in the step (so the step's loss is `sum over tokens / sequences`, as in
  PipelineRL), clips the gradient norm, steps AdamW and the warm-up + cosine schedule, and
  clears the gradients. A step with no trained sequence (all filtered) leaves the weights as
  they are (AdamW skips parameters without gradients) but still advances the schedule.
- The model runs in eval mode: no dropout, so the recomputed logprobs are the sampler's (the
  gradient flows all the same).
- Deterministic on CPU (`configure_determinism`): the same micro-batches in the same order give
  bit-identical weights, so a checksum (`checksum()`) identifies a version.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stream_rl.config import RunConfig, TrainerConfig
from stream_rl.contracts import TrainingSample
from stream_rl.errors import ConfigError
from stream_rl.rl.logprobs import token_entropy, token_logprobs
from stream_rl.rl.losses import policy_loss
from stream_rl.rl.schedule import make_lr_lambda
from stream_rl.rl.stats import TokenStats
from stream_rl.train.packing import PackedBatch, pack_samples

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def configure_determinism(deterministic: bool, seed: int, threads: int) -> None:
    """Fix the thread count, seed every RNG, and (when `deterministic`) ask torch for
    deterministic kernels. The thread count is part of the guarantee: CPU reductions split
    work by thread."""
    torch.set_num_threads(threads)
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # numpy is a dependency; this only guards odd installs
        pass
    if deterministic:
        torch.use_deterministic_algorithms(True)


def load_model(path: str | Path, dtype: str, device: str) -> nn.Module:
    """The causal LM in `path` (a local HF directory), in eval mode, on `device`."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ConfigError(
            f"model.path {path!r} is not a model directory (no config.json); "
            "build one with `stream-rl make-model --preset tiny --out DIR`"
        )
    model: Any = AutoModelForCausalLM.from_pretrained(str(p), dtype=DTYPES[dtype], attn_implementation="sdpa")
    cfg = model.config
    # The LM head is applied by hand to completion positions only: models whose forward
    # post-processes logits would be scored wrongly.
    for attr in ("final_logit_softcapping", "logit_scale"):
        if getattr(cfg, attr, None) not in (None, 1.0):
            raise ConfigError(
                f"model {path}: {attr} is set; the trainer does not support logit post-processing"
            )
    model.to(device)
    model.eval()
    return model


@dataclass
class MicroResult:
    loss: float
    """Summed (not yet divided by the step's sequences) loss of this micro-batch."""
    stats: TokenStats
    real_tokens: int
    padded_tokens: int


@dataclass
class StepOutcome:
    grad_norm: float
    """Total gradient norm before clipping."""
    lr: float
    """Learning rate used by this step."""


class PolicyTrainer:
    """Model, optimizer and schedule of one trainer process (plain torch backend)."""

    def __init__(
        self,
        model: nn.Module,
        cfg: TrainerConfig,
        *,
        temperature: float,
        device: str = "cpu",
        ref_model: nn.Module | None = None,
    ) -> None:
        if temperature <= 0:
            raise ConfigError(
                "actor.sampling.temperature must be > 0 for training (logprobs are recomputed at it)"
            )
        if cfg.kl_coef > 0 and ref_model is None:
            raise ConfigError("trainer.kl_coef > 0 needs a reference model")
        self.model: Any = model  # a transformers causal LM (typed loosely: nn.Module hides its API)
        self.cfg = cfg
        self.temperature = temperature
        self.device = torch.device(device)
        self.ref_model = ref_model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            make_lr_lambda(
                warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps, min_lr_ratio=cfg.min_lr_ratio
            ),
        )

    # -- forward -----------------------------------------------------------------------------

    def _hidden(self, model: Any, packed: PackedBatch) -> torch.Tensor:
        out = model.get_decoder()(
            input_ids=packed.input_ids.to(self.device),
            position_ids=packed.position_ids.to(self.device),
            use_cache=False,
        )
        hidden: torch.Tensor = out.last_hidden_state
        return hidden[packed.rows.to(self.device), packed.cols.to(self.device)]

    def completion_logits(self, packed: PackedBatch, model: nn.Module | None = None) -> torch.Tensor:
        """[N, V] logits predicting each completion token (with gradient)."""
        m: Any = model if model is not None else self.model
        head = m.get_output_embeddings()
        logits: torch.Tensor = head(self._hidden(m, packed))
        return logits

    def logprobs(self, samples: list[TrainingSample]) -> torch.Tensor:
        """Flat [N] logprobs of the samples' completion tokens at the sampling temperature (no grad)."""
        packed = pack_samples(samples, self.cfg.pack_row_tokens)
        with torch.no_grad():
            return token_logprobs(
                self.completion_logits(packed), packed.labels.to(self.device), self.temperature
            ).float()

    # -- one micro-batch ---------------------------------------------------------------------

    def micro_batch(self, samples: list[TrainingSample]) -> MicroResult:
        """Forward and backward one micro-batch; gradients accumulate until `optimizer_step`."""
        cfg = self.cfg
        packed = pack_samples(samples, cfg.pack_row_tokens)
        dev = self.device
        labels = packed.labels.to(dev)
        logits = self.completion_logits(packed)
        logp = token_logprobs(logits, labels, self.temperature)
        if cfg.entropy_coef > 0:
            entropy = token_entropy(logits, self.temperature)
        else:
            with torch.no_grad():
                entropy = token_entropy(logits.detach(), self.temperature)
        ref_logp = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref_logits = self.completion_logits(packed, self.ref_model)
                ref_logp = token_logprobs(ref_logits, labels, self.temperature)
        out = policy_loss(
            logp,
            packed.behaviour_logprobs.to(dev),
            packed.advantages.to(dev),
            packed.loss_mask.to(dev),
            num_sequences=1,
            policy_loss=cfg.policy_loss,
            eps_low=cfg.eps_low,
            eps_high=cfg.eps_high,
            ref_logp=ref_logp,
            kl_coef=cfg.kl_coef,
            entropy=entropy,
            entropy_coef=cfg.entropy_coef,
            truncated=packed.truncated.to(dev),
            overlong_filtering=cfg.overlong_filtering,
        )
        out.loss.backward()
        return MicroResult(
            loss=float(out.loss.detach().item()),
            stats=out.stats,
            real_tokens=packed.real_tokens,
            padded_tokens=packed.padded_tokens,
        )

    # -- one optimizer step ------------------------------------------------------------------

    def optimizer_step(self, num_sequences: int) -> StepOutcome:
        """Average the accumulated gradients over `num_sequences`, clip, step AdamW and the schedule."""
        grads = [p for p in self.params if p.grad is not None]
        if num_sequences > 0:
            for p in grads:
                assert p.grad is not None
                p.grad.div_(num_sequences)
        grad_norm = 0.0
        if grads:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(grads, self.cfg.grad_clip).item())
        lr = float(self.scheduler.get_last_lr()[0])
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepOutcome(grad_norm=grad_norm, lr=lr)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().num_embeddings)

    # -- weights -----------------------------------------------------------------------------

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The parameters to broadcast and checksum, in `named_parameters()` order (tied once)."""
        return [(name, p.detach()) for name, p in self.model.named_parameters()]

    def checksum(self) -> str:
        from stream_rl.weights.checksum import weights_checksum

        return weights_checksum(self.named_weights())

    def state_dicts(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dicts(self, optimizer: dict[str, Any], scheduler: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(optimizer)
        self.scheduler.load_state_dict(scheduler)


def build_trainer(config: RunConfig, weights: str | Path | None = None) -> PolicyTrainer:
    """Determinism settings, then the model (`weights`, default `model.path`), the reference
    model when `kl_coef > 0` (always `model.path`: the initial policy), optimizer and schedule."""
    tcfg = config.trainer
    configure_determinism(tcfg.deterministic, tcfg.seed, tcfg.torch_threads)
    model = load_model(weights if weights is not None else config.model.path, config.model.dtype, tcfg.device)
    ref = None
    if tcfg.kl_coef > 0:
        ref = load_model(config.model.path, config.model.dtype, tcfg.device).requires_grad_(False)
    return PolicyTrainer(
        model, tcfg, temperature=config.actor.sampling.temperature, device=tcfg.device, ref_model=ref
    )
