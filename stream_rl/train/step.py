"""The model step of the trainer: micro-batch forward/backward and one AdamW step.

Contract:
- `PolicyTrainer.micro_batch(samples)` packs the samples (`stream_rl.train.rows`: rows of
  `pack_row_tokens`, a longer sample in a forward pass of its own), recomputes
  the completion tokens' logprobs at the sampling temperature (`log_softmax(logits / T)` at the
  next-token labels; the LM head runs on completion positions only), and back-propagates the
  *summed* policy loss (`stream_rl.rl.losses.policy_loss` with `num_sequences=1`), one backward
  per forward pass, so the activations of one pass at a time are held. Gradients accumulate
  across passes and micro-batches. Each sample is whole in one pass, and the loss gets each
  token's sample (`sample_of_token`) as its sequence id: `gspo`'s per-sequence ratio and
  `seq_ratio_mean` need them.
- `PolicyTrainer.optimizer_step(num_sequences)` divides the accumulated gradients by the number
  of sequences trained in the step (so the step's loss is `sum over tokens / sequences` for the
  token-level losses, as in PipelineRL, and gspo's mean of its per-sequence objectives), clips
  the gradient norm, steps AdamW and the warm-up + cosine schedule, and clears the gradients.
  A step with no trained sequence (all filtered) leaves the weights as they are (AdamW skips
  parameters without gradients) but still advances the schedule.
- The model runs in eval mode: no dropout, so the recomputed logprobs are the sampler's (the
  gradient flows all the same).
- Deterministic on CPU (`configure_determinism`): the same micro-batches in the same order give
  bit-identical weights, so a checksum (`checksum()`) identifies a version.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from stream_rl.common.modeling import enable_gradient_checkpointing, load_causal_lm
from stream_rl.config import TrainerConfig
from stream_rl.contracts import TrainingSample
from stream_rl.errors import ConfigError
from stream_rl.rl.logprobs import token_entropy, token_logprobs
from stream_rl.rl.losses import LossOutput, policy_loss
from stream_rl.rl.schedule import make_lr_lambda
from stream_rl.rl.stats import TokenStats
from stream_rl.train.precision import MasterWeights
from stream_rl.train.rows import PackedBatch, pack_forwards

MASTER_WEIGHTS_FILE = "master_weights.pt"
"""Checkpoint file of the float32 master weights of a bf16 model (absent for float32 models)."""


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


def load_model(
    path: str | Path, dtype: str, device: str, attn_implementation: str = "sdpa", runs_in: str | None = None
) -> nn.Module:
    """The causal LM in `path` (a local HF directory), in eval mode, on `device`, in `dtype` with
    an untied lm_head kept float32 for bf16/fp16 (`stream_rl.common.modeling`)."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ConfigError(
            f"model.path {path!r} is not a model directory (no config.json); "
            "build one with `stream-rl make-model --preset tiny --out DIR`"
        )
    model: Any = load_causal_lm(
        p, dtype=dtype, attn_implementation=attn_implementation, device=device, runs_in=runs_in
    )
    cfg = model.config
    # The LM head is applied by hand to completion positions only: models whose forward
    # post-processes logits would be scored wrongly.
    for attr in ("final_logit_softcapping", "logit_scale"):
        if getattr(cfg, attr, None) not in (None, 1.0):
            raise ConfigError(
                f"model {path}: {attr} is set; the trainer does not support logit post-processing"
            )
    model.eval()
    return model


@dataclass
class MicroResult:
    loss: float
    """Summed (not yet divided by the step's sequences) loss of this micro-batch."""
    stats: TokenStats
    real_tokens: int
    padded_tokens: int
    finite: bool = True
    """False: a forward pass's loss was not finite and that pass was not back-propagated (its
    loss, stats and tokens are left out of the fields above; the micro-batch's other passes,
    if any, trained as usual). With one pass (the usual case) nothing was back-propagated."""


@dataclass
class StepOutcome:
    grad_norm: float
    """Total gradient norm before clipping."""
    lr: float
    """Learning rate used by this step."""
    loss_sum: float | None = None
    """Backends that train at step time (DeepSpeed) report the step's summed loss here..."""
    stats: TokenStats | None = None
    """...and its token statistics (the torch backend reports them per micro-batch instead)."""
    skipped: bool = False
    """The gradient norm was not finite: the step was not applied (gradients cleared)."""


class TrainerBackend(Protocol):
    """What the stage and the replay need from a backend (`PolicyTrainer`, `DeepSpeedTrainer`)."""

    @property
    def vocab_size(self) -> int: ...

    def micro_batch(self, samples: list[TrainingSample]) -> MicroResult: ...

    def optimizer_step(self, num_sequences: int) -> StepOutcome: ...

    def full_weights(self) -> AbstractContextManager[list[tuple[str, torch.Tensor]]]: ...

    def checksum(self) -> str: ...

    def save_to(self, directory: Path) -> None: ...

    def load_from(self, directory: Path) -> None: ...

    def close(self) -> None: ...


def completion_logits(model: Any, packed: PackedBatch, device: torch.device) -> torch.Tensor:
    """[N, V] logits predicting each completion token of `packed` (with gradient): the decoder on
    the packed rows, the LM head on the predicting positions only."""
    out = model.get_decoder()(
        input_ids=packed.input_ids.to(device), position_ids=packed.position_ids.to(device), use_cache=False
    )
    hidden = out.last_hidden_state[packed.rows.to(device), packed.cols.to(device)]
    logits: torch.Tensor = model.get_output_embeddings()(hidden)
    return logits


class Scorer(nn.Module):
    """The causal LM as a sharded backend's top-level module (DeepSpeed's engine, FSDP2's root
    unit): forward gives the completion logits, so the parameter hooks (ZeRO-3's gathers, FSDP2's
    all-gathers) see one forward per pass."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, packed: Any, device: torch.device) -> torch.Tensor:
        return completion_logits(self.lm, packed, device)


def micro_loss(
    cfg: TrainerConfig,
    temperature: float,
    logits: torch.Tensor,
    packed: PackedBatch,
    ref_logits: torch.Tensor | None = None,
) -> LossOutput:
    """The summed policy loss (`num_sequences=1`) of one packed micro-batch and its statistics."""
    dev = logits.device
    labels = packed.labels.to(dev)
    logp = token_logprobs(logits, labels, temperature)
    if cfg.entropy_coef > 0:
        entropy = token_entropy(logits, temperature)
    else:
        with torch.no_grad():
            entropy = token_entropy(logits.detach(), temperature)
    ref_logp = None
    if ref_logits is not None:
        ref_logp = token_logprobs(ref_logits, labels, temperature)
    return policy_loss(
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
        sequence_ids=packed.sample_of_token.to(dev),
    )


def check_training_setup(cfg: TrainerConfig, temperature: float, has_ref: bool) -> None:
    if temperature <= 0:
        raise ConfigError(
            "actor.sampling.temperature must be > 0 for training (logprobs are recomputed at it)"
        )
    if cfg.kl_coef > 0 and not has_ref:
        raise ConfigError("trainer.kl_coef > 0 needs a reference model")


class PolicyTrainer:
    """Model, optimizer and schedule of one trainer process (plain torch backend).

    The interface the stage and the replay use (the DeepSpeed backend has the same):
    `micro_batch`, `optimizer_step`, `full_weights` (a context yielding the named tensors to
    checksum and broadcast), `checksum`, `vocab_size`, `save_to`/`load_from` (checkpoint files)
    and `close`.
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: TrainerConfig,
        *,
        temperature: float,
        device: str = "cpu",
        ref_model: nn.Module | None = None,
    ) -> None:
        check_training_setup(cfg, temperature, ref_model is not None)
        self.model: Any = model  # a transformers causal LM (typed loosely: nn.Module hides its API)
        self.cfg = cfg
        self.temperature = temperature
        self.device = torch.device(device)
        self.ref_model = ref_model
        if cfg.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        # bf16 parameters are trained through float32 master copies (precision.py): the
        # optimizer, clipping and the accumulated gradients are float32.
        self.precision = MasterWeights(self.params)
        self.optimizer = torch.optim.AdamW(
            self.precision.masters, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            make_lr_lambda(
                warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps, min_lr_ratio=cfg.min_lr_ratio
            ),
        )

    def logprobs(self, samples: list[TrainingSample]) -> torch.Tensor:
        """Flat [N] logprobs of the samples' completion tokens at the sampling temperature (no grad),
        in sample order, then token order."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(samples)
        with torch.no_grad():
            for packed, part in pack_forwards(samples, self.cfg.pack_row_tokens):
                logits = completion_logits(self.model, packed, self.device)
                logp = token_logprobs(logits, packed.labels.to(self.device), self.temperature).float()
                for i, piece in zip(part, logp.split([samples[i].completion_len for i in part]), strict=True):
                    out[i] = piece
        return torch.cat(out)

    def micro_batch(self, samples: list[TrainingSample]) -> MicroResult:
        """Forward and backward one micro-batch (one backward per forward pass: a sample longer
        than a row has a pass of its own); gradients accumulate until `optimizer_step`."""
        loss, stats, real, padded, finite = 0.0, TokenStats(), 0, 0, True
        for packed, _ in pack_forwards(samples, self.cfg.pack_row_tokens):
            logits = completion_logits(self.model, packed, self.device)
            ref_logits = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref_logits = completion_logits(self.ref_model, packed, self.device)
            out = micro_loss(self.cfg, self.temperature, logits, packed, ref_logits)
            if not bool(torch.isfinite(out.loss.detach())):
                # Nothing non-finite may reach the gradients: this pass is dropped, counted.
                finite = False
                continue
            out.loss.backward()
            self.precision.accumulate()
            loss += float(out.loss.detach().item())
            stats = stats + out.stats
            real += packed.real_tokens
            padded += packed.padded_tokens
        return MicroResult(loss=loss, stats=stats, real_tokens=real, padded_tokens=padded, finite=finite)

    def optimizer_step(self, num_sequences: int) -> StepOutcome:
        """Average the accumulated gradients over `num_sequences`, clip, step AdamW and the schedule."""
        grads = [p for p in self.precision.masters if p.grad is not None]
        if num_sequences > 0:
            for p in grads:
                assert p.grad is not None
                p.grad.div_(num_sequences)
        grad_norm = 0.0
        if grads:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(grads, self.cfg.grad_clip).item())
        lr = float(self.scheduler.get_last_lr()[0])
        skipped = not math.isfinite(grad_norm)
        if not skipped:  # a non-finite gradient is never applied: weights and AdamW state stay
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.precision.publish()
        return StepOutcome(grad_norm=grad_norm, lr=lr, skipped=skipped)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().num_embeddings)

    @contextmanager
    def full_weights(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The parameters to broadcast and checksum, in `named_parameters()` order (tied once)."""
        yield [(name, p.detach()) for name, p in self.model.named_parameters()]

    def checksum(self) -> str:
        from stream_rl.weights.checksum import weights_checksum

        with self.full_weights() as named:
            return weights_checksum(named)

    def save_to(self, directory: Path) -> None:
        """Write the checkpoint's model (HF safetensors) and optimizer/scheduler files."""
        self.model.save_pretrained(str(directory / "model"))
        torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")
        torch.save(self.scheduler.state_dict(), directory / "scheduler.pt")
        if self.precision.mixed:
            torch.save(self.precision.state_dict(), directory / MASTER_WEIGHTS_FILE)

    def load_from(self, directory: Path) -> None:
        """Restore optimizer and scheduler state (the weights were loaded from `directory/model`)."""
        self.optimizer.load_state_dict(torch.load(directory / "optimizer.pt", weights_only=True))
        self.scheduler.load_state_dict(torch.load(directory / "scheduler.pt", weights_only=True))
        masters = directory / MASTER_WEIGHTS_FILE
        if self.precision.mixed and masters.is_file():
            self.precision.load_state_dict(torch.load(masters, weights_only=True))

    def close(self) -> None:
        return None
