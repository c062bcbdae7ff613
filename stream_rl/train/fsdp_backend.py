"""FSDP2 (`torch.distributed.fsdp.fully_shard`) behind the trainer stage (`trainer.backend: fsdp2`).

Process model and commands as in `stream_rl.train.deepspeed_backend`, both on
`stream_rl.train.ranks` (the gloo control channel, step encoding, statistics reduction): N ranks
launched with `torchrun` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK), each running
`stream-rl trainer --config ...`; rank 0 runs the stage with an `FSDP2Trainer`, the others
`follow()` its commands on the control group:
- STEP: micro-batch i is trained by rank i mod N, ranks with fewer run zero-weight passes (every
  pass all-gathers parameters in forward and reduce-scatters gradients in backward, so all ranks
  run the same number). Gradients are averaged over ranks by the reduce-scatter, so each loss is
  scaled by N / sequences: the step's loss is the token sum over its sequences, as with the torch
  backend. Then clipping (`clip_grad_norm_` on the sharded gradients: a global norm), AdamW on the
  shards, the warm-up + cosine schedule. A non-finite norm skips the update, as with torch.
- WEIGHTS: every rank calls `DTensor.full_tensor()` on each parameter in `named_parameters()`
  order (an all-gather); rank 0 checksums and pushes them.
- SAVE `dir` / LOAD `dir`: model and AdamW state as a sharded `torch.distributed.checkpoint`
  under `dir/fsdp` (each rank writes its shards: a shared filesystem is assumed), the schedule in
  `dir/scheduler.pt`; rank 0 also writes the HF `save_pretrained` weights (the full state dict).
- STOP.
Each decoder layer is its own FSDP unit, the root (embeddings, final norm, head) another. bf16:
`MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)` over float32 shards (the
master weights), weights pushed cast to bf16 (an untied head float32, as `stream_rl.common.modeling`
loads it); float16 is refused (no loss scaling). Verified on CPU with gloo (torch 2.13); the same
code picks NCCL and the rank's GPU with `trainer.device: cuda` (not run here: no GPU).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stream_rl.common.modeling import enable_gradient_checkpointing, untied_head_name
from stream_rl.config import RunConfig, TrainerConfig
from stream_rl.contracts import TrainingBatch
from stream_rl.errors import ConfigError
from stream_rl.rl.schedule import make_lr_lambda
from stream_rl.rl.stats import TokenStats
from stream_rl.train.ranks import (
    OP_LOAD,
    OP_SAVE,
    OP_STEP,
    OP_STOP,
    OP_WEIGHTS,
    Control,
    RankZero,
    decode_step,
    reduce_stats,
)
from stream_rl.train.rows import pack_samples
from stream_rl.train.step import (
    Scorer,
    StepOutcome,
    check_training_setup,
    configure_determinism,
    load_model,
    micro_loss,
)

log = logging.getLogger(__name__)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The full value of a DTensor (collective), a plain tensor as is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class FSDP2Trainer(RankZero):
    """`PolicyTrainer`'s interface on an FSDP2-sharded model; rank 0 drives, the others `follow()`."""

    def __init__(self, lm: nn.Module, cfg: TrainerConfig, *, temperature: float, dtype: str) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        check_training_setup(cfg, temperature, has_ref=False)
        if cfg.kl_coef > 0:
            raise ConfigError("trainer.kl_coef > 0 is not supported by the fsdp2 backend yet")
        if dtype == "float16":
            raise ConfigError(
                "model.dtype: float16 is not trained by trainer.backend: fsdp2 (no loss scaling)"
            )
        self.cfg = cfg
        self.temperature = temperature
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.control = Control()
        self._vocab = int(lm.get_input_embeddings().num_embeddings)  # type: ignore[operator]
        self._dtype = getattr(torch, dtype)
        self._fp32_head = untied_head_name(lm) if dtype == "bfloat16" else None
        lm.eval()  # no dropout: the recomputed logprobs must be the sampler's
        if cfg.gradient_checkpointing:
            enable_gradient_checkpointing(lm)
        mp = MixedPrecisionPolicy(param_dtype=self._dtype, reduce_dtype=torch.float32)
        for layer in lm.get_decoder().layers:  # type: ignore[operator]
            fully_shard(layer, mp_policy=mp)
        self.module = Scorer(lm)
        fully_shard(self.module, mp_policy=mp)
        self.lm = lm
        self.device = next(lm.parameters()).device
        self.optimizer = torch.optim.AdamW(
            self.module.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            make_lr_lambda(
                warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps, min_lr_ratio=cfg.min_lr_ratio
            ),
        )
        self._pending: list[TrainingBatch] = []

    # -- the PolicyTrainer interface (rank 0) ----------------------------------------------------

    @contextmanager
    def full_weights(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        if self.rank == 0:
            self.control.send(OP_WEIGHTS)
        yield self._gather()

    # -- what every rank runs ------------------------------------------------------------------

    def _gather(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        for name, p in self.lm.named_parameters():
            full = _local(p.detach())
            out.append((name, full if name == self._fp32_head else full.to(self._dtype)))
        return out

    def _step(self, batches: list[TrainingBatch], sequences: int) -> StepOutcome:
        lr = float(self.scheduler.get_last_lr()[0])
        if sequences == 0 or not batches:
            self.scheduler.step()  # nothing trained: weights and optimizer untouched, as with torch
            return StepOutcome(grad_norm=0.0, lr=lr, loss_sum=0.0, stats=TokenStats())
        mine = batches[self.rank :: self.world]
        passes = -(-len(batches) // self.world)
        scale = self.world / sequences
        loss_sum, stats = 0.0, TokenStats()
        for i in range(passes):
            real = i < len(mine)
            samples = mine[i].samples if real else batches[0].samples[:1]
            packed = pack_samples(samples, self.cfg.pack_row_tokens)
            logits = self.module(packed, self.device)
            out = micro_loss(self.cfg, self.temperature, logits, packed)
            (out.loss * (scale if real else 0.0)).backward()
            if real:
                loss_sum += float(out.loss.detach().item())
                stats = stats + out.stats
        norm = float(_local(torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.grad_clip)))
        skipped = not math.isfinite(norm)
        if not skipped:  # the norm is global, so every rank decides alike
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.tensor([loss_sum], dtype=torch.float64)
        dist.all_reduce(total, group=self.control.group)
        return StepOutcome(
            grad_norm=norm,
            lr=lr,
            loss_sum=float(total.item()),
            stats=reduce_stats(stats, self.control.group),
            skipped=skipped,
        )

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.module, self.optimizer)
        return {"model": model, "optim": optim}

    def _save(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        dcp.save(self._state(), checkpoint_id=str(directory / "fsdp"))
        full: dict[str, Any] = get_model_state_dict(
            self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if self.rank == 0:
            torch.save(self.scheduler.state_dict(), directory / "scheduler.pt")
            # A tied head is one parameter under two names: saved once, as `save_pretrained` does.
            names = {n for n, _ in self.lm.named_parameters(remove_duplicate=False)}
            tied = names - {n for n, _ in self.lm.named_parameters()}
            lm_state = {
                k.removeprefix("lm."): v.to(self._dtype)
                for k, v in full.items()
                if k.removeprefix("lm.") not in tied
            }
            if self._fp32_head is not None:
                lm_state[self._fp32_head] = full["lm." + self._fp32_head]
            self.lm.save_pretrained(str(directory / "model"), state_dict=lm_state)  # type: ignore[operator]
        dist.barrier(group=self.control.group)

    def _load(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._state()
        dcp.load(state, checkpoint_id=str(directory / "fsdp"))
        set_state_dict(
            self.module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        self.scheduler.load_state_dict(torch.load(directory / "scheduler.pt", weights_only=True))

    def follow(self) -> None:
        """The loop of ranks > 0: execute rank 0's commands until STOP."""
        while True:
            op, payload = self.control.receive()
            if op == OP_STEP:
                self._step(*decode_step(payload))
            elif op == OP_WEIGHTS:
                self._gather()
            elif op == OP_SAVE:
                self._save(Path(payload.decode()))
            elif op == OP_LOAD:
                self._load(Path(payload.decode()))
            elif op == OP_STOP:
                return
            else:
                raise ConfigError(f"fsdp2 follower: unknown command {op}")


def init_distributed(device: str) -> None:
    """Join the trainer's process group from the launcher's environment (idempotent); a process
    started without a launcher (`replay trainer`, a rebuild) is a group of one."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        from stream_rl.common.ports import free_port

        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group(backend="nccl" if device == "cuda" else "gloo")


def build_fsdp2_trainer(config: RunConfig, weights: str | Path | None = None) -> FSDP2Trainer:
    """The model (`weights`, default `model.path`) sharded with FSDP2; every rank calls this, in
    the same order."""
    tcfg = config.trainer
    init_distributed(tcfg.device)
    configure_determinism(tcfg.deterministic, tcfg.seed, tcfg.torch_threads)
    if tcfg.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = f"cuda:{torch.cuda.current_device()}" if tcfg.device == "cuda" else "cpu"
    # Loaded in float32: the shards are the master weights; MixedPrecisionPolicy casts for compute.
    path = weights if weights is not None else config.model.path
    lm = load_model(path, "float32", device, config.model.attn_implementation, runs_in=config.model.dtype)
    return FSDP2Trainer(lm, tcfg, temperature=config.actor.sampling.temperature, dtype=config.model.dtype)


def follow(config: RunConfig) -> None:
    """A rank > 0: build the same sharded model as rank 0 (from the same latest checkpoint), then
    execute rank 0's commands until it stops."""
    from stream_rl.train.checkpoint import checkpoint_root, latest_checkpoint

    ckpt = latest_checkpoint(checkpoint_root(config))
    trainer = build_fsdp2_trainer(config, ckpt / "model" if ckpt else None)
    trainer.follow()
