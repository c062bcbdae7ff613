"""DeepSpeed ZeRO (stage 2 or 3) behind the trainer stage (`trainer.backend: deepspeed`).

Process model: launch N ranks with `deepspeed` or `torchrun` (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, LOCAL_RANK set), each running `stream-rl trainer --config ...`. Rank 0 runs the
stage (Kafka, weight push, publishing, checkpoints' bookkeeping) with a `DeepSpeedTrainer`;
every other rank runs `follow()`, executing the same collective operations in the same order.
Rank 0 announces each operation on a gloo control group (NCCL or gloo carries ZeRO's own
traffic) as a command, `[op, payload bytes]` (`stream_rl.train.ranks`, shared with fsdp2):
- STEP: the step's micro-batches, Avro single-object encoded (as on Kafka; nothing pickled), and
  the number of trained sequences. Micro-batch i is trained by rank i mod N; ranks with fewer
  micro-batches run zero-weight passes, so every rank runs the same number of forward/backward
  passes (ZeRO-3 gathers parameters in forward, ZeRO reduces gradients in backward). The last
  pass sets the gradient-accumulation boundary, then `engine.step()` (clipping, AdamW, the
  warm-up + cosine schedule). Each loss is scaled by N / sequences, since ZeRO averages
  gradients over ranks: the step's loss is the token sum over the step's sequences, as with the
  torch backend. Micro-batches are therefore trained when the step is complete (rank 0 buffers
  them), not as they arrive.
- WEIGHTS: all ranks enter `deepspeed.zero.GatheredParameters` (a no-op for ZeRO-2) while rank 0
  checksums and broadcasts the full weights.
- SAVE `dir` / LOAD `dir`: `engine.save_checkpoint` / `load_checkpoint` (collective; a shared
  filesystem is assumed); rank 0 also writes the HF `save_pretrained` weights.
- STOP.
Token statistics are summed over ranks (`ratio_max` by max) and reported by `optimizer_step`.
The model is loaded whole on every rank before ZeRO partitions it (no `zero.Init`): fine for
models that fit in host memory. Bit-exact replay is a property of the torch backend on CPU only.
No DeepSpeed op is compiled (`skip_shm_comm_op`): ZeRO's collectives are torch.distributed's.
"""

from __future__ import annotations

import logging
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

DS_BUCKET = 500_000_000
"""DeepSpeed's default reduce and all-gather bucket, in elements."""


def ds_config(tcfg: TrainerConfig, dtype: str, zero_stage: int, numel: int) -> dict[str, Any]:
    """The engine's config. Its buckets hold at most the model's `numel` parameters: at DeepSpeed's
    default (5e8 elements, 2 GB in float32) ZeRO-2 allocates such a buffer at every micro-batch
    whatever the model (tests/integration/test_deepspeed_backend.py, a 0.5M-parameter model: 20 s
    of system CPU before, 11 s after); a model over 5e8 parameters gets the default."""
    bucket = min(DS_BUCKET, max(numel, 1))
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,  # the boundary is set by hand: steps vary in micro-batches
        "gradient_clipping": tcfg.grad_clip,
        "zero_optimization": {
            "stage": zero_stage,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
        },
        "bf16": {"enabled": dtype == "bfloat16"},
        "fp16": {"enabled": dtype == "float16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
    }


class DeepSpeedTrainer(RankZero):
    """`PolicyTrainer`'s interface on a DeepSpeed engine; rank 0 drives, the others `follow()`."""

    def __init__(
        self, lm: nn.Module, cfg: TrainerConfig, *, temperature: float, dtype: str, zero_stage: int
    ) -> None:
        import deepspeed

        check_training_setup(cfg, temperature, has_ref=False)
        if cfg.kl_coef > 0:
            raise ConfigError("trainer.kl_coef > 0 is not supported by the deepspeed backend yet")
        self.cfg = cfg
        self.temperature = temperature
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.control = Control()
        self._vocab = int(lm.get_input_embeddings().num_embeddings)  # type: ignore[operator]
        optimizer = torch.optim.AdamW(
            lm.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
        )
        schedule = make_lr_lambda(
            warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps, min_lr_ratio=cfg.min_lr_ratio
        )
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=Scorer(lm),
            optimizer=optimizer,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
            config=ds_config(cfg, dtype, zero_stage, sum(p.numel() for p in lm.parameters())),
        )
        self.engine.eval()  # no dropout: the recomputed logprobs must be the sampler's
        if cfg.gradient_checkpointing:  # after eval(): it flags the checkpointed layers `training`
            enable_gradient_checkpointing(self.engine.module.lm)
        # DeepSpeed casts the whole module to bf16/fp16 (its fp32 master weights live in the
        # optimizer); servers loaded in that dtype hold an untied lm_head in float32
        # (stream_rl.common.modeling), so that one is pushed upcast: same values, the servers' dtype.
        self._fp32_head = untied_head_name(lm) if dtype in ("bfloat16", "float16") else None
        self.device = self.engine.device
        self.zero_stage = zero_stage
        self._pending: list[TrainingBatch] = []

    # -- the PolicyTrainer interface (rank 0) ----------------------------------------------------

    @contextmanager
    def full_weights(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        if self.rank == 0:
            self.control.send(OP_WEIGHTS)
        with self._gathered():
            yield [
                (n, p.detach().float() if n == self._fp32_head else p.detach())
                for n, p in self.engine.module.lm.named_parameters()
            ]

    # -- what every rank runs ------------------------------------------------------------------

    @contextmanager
    def _gathered(self) -> Iterator[None]:
        if self.zero_stage < 3:
            yield
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(self.engine.module.parameters()), modifier_rank=None):
            yield

    def _step(self, batches: list[TrainingBatch], sequences: int) -> StepOutcome:
        lr = float(self.engine.get_lr()[0])
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
            self.engine.set_gradient_accumulation_boundary(i == passes - 1)
            logits = self.engine(packed, self.device)
            out = micro_loss(self.cfg, self.temperature, logits, packed)
            self.engine.backward(out.loss * (scale if real else 0.0))
            if real:
                loss_sum += float(out.loss.detach().item())
                stats = stats + out.stats
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        total = torch.tensor([loss_sum], dtype=torch.float64)
        dist.all_reduce(total, group=self.control.group)
        return StepOutcome(
            grad_norm=float(norm) if norm is not None else 0.0,
            lr=lr,
            loss_sum=float(total.item()),
            stats=reduce_stats(stats, self.control.group),
        )

    def _save(self, directory: Path) -> None:
        self.engine.save_checkpoint(str(directory / "deepspeed"), tag="state")
        with self._gathered():
            if self.rank == 0:
                self.engine.module.lm.save_pretrained(str(directory / "model"))
        dist.barrier(group=self.control.group)

    def _load(self, directory: Path) -> None:
        self.engine.load_checkpoint(str(directory / "deepspeed"), tag="state")

    def follow(self) -> None:
        """The loop of ranks > 0: execute rank 0's commands until STOP."""
        while True:
            op, payload = self.control.receive()
            if op == OP_STEP:
                self._step(*decode_step(payload))
            elif op == OP_WEIGHTS:
                with self._gathered():
                    pass
            elif op == OP_SAVE:
                self._save(Path(payload.decode()))
            elif op == OP_LOAD:
                self._load(Path(payload.decode()))
            elif op == OP_STOP:
                return
            else:
                raise ConfigError(f"deepspeed follower: unknown command {op}")


def skip_shm_comm_op() -> None:
    """Tell DeepSpeed not to build its shared-memory all-reduce op (`deepspeed_shm_comm`).

    DeepSpeed's CPU accelerator JIT-compiles that op in every `init_distributed` (also the one
    inside `deepspeed.initialize`), yet only its inference all-reduce (AutoTP) uses it: ZeRO's
    collectives go through torch.distributed either way. The build runs under
    `~/.cache/torch_extensions/<py>/deepspeed_shm_comm/lock`, a file torch waits on forever and
    never breaks: a rank killed while compiling (each environment's install path rewrites the
    build file, so a new venv recompiles, ~30 s) left it behind, and every later launch on the
    machine hung in `init_distributed`. Marked not compatible, the op is never built (no compiler,
    no shared lock) and DeepSpeed falls back to the process group's all-reduce."""
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


def init_distributed(device: str) -> None:
    """Join the trainer's process group from the launcher's environment (idempotent)."""
    import deepspeed

    skip_shm_comm_op()
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")


def build_deepspeed_trainer(config: RunConfig, weights: str | Path | None = None) -> DeepSpeedTrainer:
    """The model (`weights`, default `model.path`) wrapped in a ZeRO engine (`trainer.zero_stage`);
    every rank calls this, in the same order."""
    tcfg = config.trainer
    init_distributed(tcfg.device)
    configure_determinism(tcfg.deterministic, tcfg.seed, tcfg.torch_threads)
    if tcfg.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = f"cuda:{torch.cuda.current_device()}" if tcfg.device == "cuda" else "cpu"
    # Loaded in float32: DeepSpeed casts to bf16/fp16 itself and keeps fp32 master weights.
    path = weights if weights is not None else config.model.path
    lm = load_model(path, "float32", device, config.model.attn_implementation, runs_in=config.model.dtype)
    return DeepSpeedTrainer(
        lm,
        tcfg,
        temperature=config.actor.sampling.temperature,
        dtype=config.model.dtype,
        zero_stage=tcfg.zero_stage,
    )


def follow(config: RunConfig) -> None:
    """A rank > 0: build the same engine as rank 0 (from the same latest checkpoint), then execute
    rank 0's commands until it stops."""
    from stream_rl.train.checkpoint import checkpoint_root, latest_checkpoint

    ckpt = latest_checkpoint(checkpoint_root(config))
    trainer = build_deepspeed_trainer(config, ckpt / "model" if ckpt else None)
    trainer.follow()
