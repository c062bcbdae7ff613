"""The stages' sections: `task`, `model`, `loader`, `actor` (and its `sampling`), `verifier`,
`preprocessor`, `trainer`, `eval`, `track`, `launcher`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from stream_rl.config.autoscale import AutoscaleConfig
from stream_rl.config.base import Model


class TaskConfig(Model):
    name: str = "arithmetic"
    """Registered task name (`arithmetic`, `math`, `guessing`)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Task-specific options, validated by the task itself (e.g. `{max_operand: 20}`)."""
    system_prompt: str | None = None
    """Optional system message prepended to every prompt."""


class ModelConfig(Model):
    path: str = "models/tiny"
    """Local Hugging Face model directory (no hub downloads)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of the trainer and the built-in engine. With bfloat16 (or float16) an untied
    lm_head stays float32 in both (PipelineRL's rule), and the torch trainer steps float32 master
    weights (`stream_rl/train/precision.py`)."""
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] = "sdpa"
    """Attention kernels of the trainer and the built-in engine (transformers' `attn_implementation`);
    `flash_attention_2` needs the flash-attn package, CUDA and a bf16/fp16 dtype."""


class SamplingConfig(Model):
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature; the trainer recomputes logprobs at the same temperature."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling. Keep 1.0 for RL: the trainer assumes the full softmax."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling (0 = off). Keep 0 for RL: the trainer assumes the full softmax."""
    max_tokens: int = Field(32, ge=1)
    """Maximum completion tokens per model call."""
    stop: list[str] = Field(default_factory=list)
    """Stop strings."""


class LoaderConfig(Model):
    epochs: int = Field(1, ge=1)
    """Passes over the task's problems; each problem is written once per epoch."""
    max_problems: int | None = Field(None, ge=1)
    """Use only the first N problems (for quick runs)."""
    seed: int = 0
    """Shuffle seed for the problem order (same seed, same order)."""


class ActorConfig(Model):
    group_size: int = Field(8, ge=1)
    """Samples per problem (the GRPO group)."""
    max_lag: int = Field(2, ge=0)
    """Admission bound: samples admitted but not trained stay under max_lag optimizer steps' worth
    (plus the step being filled). Ignored in conventional mode."""
    straggler_guard: bool = True
    """While a group admitted earlier is still generating, the admission window does not move past
    it, so every token is trained at most max_lag versions after it was sampled (long, variable
    completions then idle the servers while a straggler finishes). False: PipelineRL's admission,
    the window moves with the trainer and bounds the lag of each sample's last tokens; a
    straggler's first tokens can be older (stream_rl/stages/admission.py)."""
    concurrency_per_server: int = Field(64, ge=1)
    """Maximum requests in flight per inference server."""
    request_timeout_s: float = Field(120.0, gt=0)
    """Timeout of one HTTP call to a server."""
    max_retries: int = Field(5, ge=0)
    """Consecutive failed calls after which a server is marked dead (taken out of routing and probed
    with `/health` later); also the retries of a request that fails while other requests succeed
    (a request the servers reject), after which its problem goes to the DLQ."""
    backoff_s: float = Field(0.2, gt=0)
    """Delay before the first retry of a failed call; doubles per retry up to `backoff_max_s`."""
    backoff_max_s: float = Field(10.0, gt=0)
    """Longest delay between retries (also while every server is dead)."""
    dead_cooldown_s: float = Field(2.0, gt=0)
    """A dead server is probed with `/health` after this; doubles while it stays down (up to 60 s)."""
    seeded_sampling: bool = True
    """Seed each request from the run seed and the rollout id, so a re-generated rollout (after a
    crash) samples the same tokens when the weights are the same."""
    refresh_s: float = Field(2.0, gt=0)
    """Admission: how often the actor group's committed offsets and DLQ count are re-read (the other
    actors' progress), with `launcher.actors` > 1; one actor reads them once, at start."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Sampling parameters of training rollouts."""


class VerifierConfig(Model):
    timeout_s: float = Field(5.0, gt=0)
    """Per-sample scoring timeout; a timeout becomes the verdict `timeout`."""
    workers: int = Field(1, ge=0)
    """Scoring processes (0 = score in the stage process, without timeouts enforcement by kill)."""
    batch_size: int = Field(64, ge=1)
    """Records scored per poll."""
    commit_every_s: float = Field(0.5, ge=0)
    """Commit consumed offsets at most this often (0: after every poll). Each commit is a broker
    write; a crash re-scores at most this much (the preprocessor drops the duplicates)."""


class PreprocessorConfig(Model):
    advantage: Literal["loo", "mean"] = "loo"
    """Baseline: leave-one-out (PipelineRL's default) or the group mean."""
    divide_by_std: bool = False
    """Divide advantages by the group's reward std."""
    filter_zero_advantage: bool = False
    """Drop groups whose advantages are all zero (counted)."""
    max_tokens_per_microbatch: int = Field(4096, ge=16)
    """Token budget of one packed micro-batch."""
    max_samples_per_microbatch: int = Field(8, ge=1)
    """Samples per micro-batch at most. The trainer never splits a micro-batch, so a step trains
    between `samples_per_step` and `samples_per_step + max_samples_per_microbatch - 1` samples;
    small micro-batches keep steps near their size (the trainer packs its rows across them)."""
    group_timeout_s: float = Field(600.0, gt=0)
    """A group still incomplete after this long is written to the DLQ (counted), not waited on forever."""
    max_untrained_batches: int = Field(64, ge=1)
    """Backpressure: hold while batches written but not yet trained exceed this (counted in offsets
    of training-batches, which include one transaction marker per transaction: conservative)."""
    batch_size: int = Field(64, ge=1)
    """Scored records per poll; each poll is one Kafka transaction."""
    linger_s: float = Field(0.5, ge=0)
    """After a poll's first records, keep collecting up to `batch_size` for this long: one
    transaction per ~half second instead of one per group. Transactions were the broker's main
    cost (measured ~2% of a core per transaction a second; README Performance); the price is up
    to this much latency before a complete group reaches the trainer."""
    dedupe_window: int = Field(2000, ge=1)
    """Closed groups remembered per partition (in the state topic) to drop late duplicates. Late
    duplicates come from a restarted upstream stage redoing its uncommitted work, a few steps'
    worth; the trainer drops any that slip through (`trainer.dedupe_window`). Its memory is held
    from start: 72 bytes a group per assigned partition (`stream_rl/common/windows.py`)."""
    max_batch_bytes: int = Field(1_000_000, ge=4096)
    """Encoded size limit of one TrainingBatch record; a larger pack is split."""


class LoraConfig(Model):
    rank: int = Field(8, ge=1)
    """LoRA rank r: each targeted weight W [out, in] trains A [r, in] and B [out, r]."""
    alpha: float = Field(16.0, gt=0)
    """LoRA alpha: the served weight is `W0 + (alpha / rank) * B @ A`."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1
    )
    """Linear layers given adapters, by module name suffix as peft matches them (Qwen2/Llama:
    `q_proj k_proj v_proj o_proj gate_proj up_proj down_proj`). Linear layers only."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training (peft's `lora_dropout`; the rest of the model
    stays in eval mode, so only the adapter path is noised)."""


class TrainerConfig(Model):
    samples_per_step: int = Field(64, ge=1)
    """Sequences per optimizer step (loss is divided by this)."""
    lr: float = Field(3e-4, gt=0)
    """AdamW learning rate (peak)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up steps."""
    max_steps: int = Field(1000, ge=1)
    """Length of the cosine schedule and of the run."""
    min_lr_ratio: float = Field(1.0, ge=0, le=1)
    """Cosine floor as a fraction of lr (1.0 = constant after warm-up)."""
    grad_clip: float = Field(1.0, gt=0)
    """Gradient-norm clipping threshold."""
    policy_loss: Literal["reinforce", "ppo", "gspo", "cispo"] = "reinforce"
    """`reinforce`: truncated IS (PipelineRL default). `ppo`: clipped surrogate, per token.
    `gspo`: clipped surrogate on the length-normalised sequence ratio (Qwen's GSPO). `cispo`:
    truncated IS with an optional lower bound on the weight (MiniMax-M1). Formulas and how each
    sums into the step's loss: `stream_rl/rl/losses.py`."""
    eps_low: float | None = Field(None, ge=0)
    """Lower clip: the ratio's `1 - eps_low` (ppo: per token; gspo: per sequence) or the IS
    weight's lower bound (cispo). None: the loss's default (ppo 0.02, gspo 3e-4, cispo no lower
    bound). reinforce has no lower bound: setting it is an error."""
    eps_high: float | None = Field(None, ge=0)
    """Upper clip: the ratio's `1 + eps_high` (ppo, gspo) or the IS weight's cap (reinforce,
    cispo). None: the loss's default (reinforce 0.02, ppo 0.02, gspo 4e-4, cispo 0.28)."""
    kl_coef: float = Field(0.0, ge=0)
    """k3 KL to the reference (initial) model."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus coefficient."""
    overlong_filtering: bool = False
    """Zero the loss of sequences that hit max_tokens."""
    checkpoint_every: int = Field(10, ge=0)
    """Checkpoint every N steps, so a killed trainer re-trains at most N steps (also at max_steps
    and on SIGTERM; 0 = only then, and a killed trainer restarts from version 0)."""
    checkpoint_dir: str | None = None
    """Checkpoint directory (default `runs/<run>/trainer/checkpoints`)."""
    deterministic: bool = True
    """Deterministic CPU kernels: the same batches give bit-identical weights."""
    seed: int = 0
    """Torch seed of the trainer."""
    bucket_mb: float = Field(16.0, gt=0)
    """Weight broadcast bucket size (MiB)."""
    push_dtype: Literal["trainer", "server"] = "trainer"
    """Dtype of the pushed tensors: `trainer`, the trainer's own (a server holding another dtype is
    refused); `server`, each tensor cast to the dtype the server holds (`GET /weights/meta`, e.g.
    `inference.dtype: bfloat16`), round-to-nearest-even: half the bytes from a float32 trainer.
    Built-in servers, gloo or nccl transport only (docs/weight-pushes.md)."""
    push_delta_threshold: float | None = Field(None, ge=0)
    """Push only the tensors that moved by more than this (max absolute difference, in the pushed
    dtype) since the version the servers hold; None: every tensor at every version. 0: exactly the
    changed tensors (servers bit-exact); above 0 a server's tensors stay within this of the
    trainer's. A server that missed a version gets every tensor. Built-in servers, gloo or nccl
    transport only; the trainer keeps one copy of the pushed weights (docs/weight-pushes.md)."""
    update_timeout_s: float = Field(60.0, gt=0)
    """A server that has not installed a version within this is taken out of routing."""
    backend: Literal["torch", "deepspeed", "fsdp2"] = "torch"
    """Trainer backend: plain torch (CPU or one GPU), DeepSpeed ZeRO (GPU, unverified here) or
    FSDP2 `fully_shard` (data-parallel ranks under torchrun; CPU/gloo or CUDA/NCCL)."""
    zero_stage: Literal[2, 3] = 3
    """ZeRO stage of the deepspeed backend (2: optimizer state and gradients partitioned;
    3: parameters too)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Trainer device."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass (less memory, ~30% more
    compute); both trainer backends."""
    weight_transport: Literal["auto", "nccl", "gloo", "cuda_ipc"] = "auto"
    """How weights reach the built-in servers: `gloo` (host memory; any device), `nccl` (GPU to
    GPU; the server on another GPU), `cuda_ipc` (trainer and server on the same GPU: the server
    copies from the trainer's buffers). `auto`: gloo for a CPU trainer; for a CUDA trainer, per
    server, cuda_ipc when the server reports the trainer's GPU, else nccl. vLLM servers use
    `inference.vllm.weight_transfer` instead."""
    torch_threads: int = Field(1, ge=1)
    """torch intra-op threads of the trainer process."""
    sync_master_port: int = Field(29500, ge=0, le=65535)
    """First TCP store port of the weight-sync groups (trainer is rank 0; one group per server
    takes the first free port from here up). 0 = any free port."""
    sync_master_addr: str = "127.0.0.1"
    """Address the inference servers use to reach the trainer's weight-sync store."""
    connect_timeout_s: float = Field(120.0, gt=0)
    """At start, keep asking the inference servers to join for this long (they may still be loading)."""
    pack_row_tokens: int = Field(512, ge=16)
    """Target row length when packing a micro-batch (rows are balanced and padded to the longest;
    a longer sample sets the length). Attention cost is quadratic in the row length, padding
    shrinks as rows grow: `bench/trainer.py` measures both."""
    dedupe_window: int = Field(20_000, ge=1)
    """Sample ids remembered (and saved with each checkpoint) so that none trains twice, whatever
    arrives on training-batches (`stream_rl/train/dedupe.py`)."""
    keep_checkpoints: int = Field(2, ge=1)
    """Checkpoints kept on disk (the oldest are deleted after a new one is durable)."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Serve Prometheus `/metrics` on this port (0 = any free port; None = off)."""
    lora: LoraConfig | None = None
    """Train LoRA adapters only (peft; the base weights stay frozen): the optimizer state and
    checkpoints hold the adapters, and built-in servers are pushed the adapter tensors
    (docs/lora.md). None: full fine-tuning. Torch backend only."""

    @model_validator(mode="after")
    def _check_clip(self) -> TrainerConfig:
        if self.lora is not None and self.backend != "torch":
            raise ValueError(
                f"trainer.lora: only trainer.backend: torch trains LoRA adapters (not {self.backend})"
            )
        if self.lora is not None and (self.push_dtype != "trainer" or self.push_delta_threshold is not None):
            raise ValueError(
                "trainer.lora pushes only the adapters: push_dtype and push_delta_threshold shape full "
                "pushes (leave them unset)"
            )
        if self.policy_loss == "reinforce" and self.eps_low is not None:
            raise ValueError(
                "trainer.eps_low: reinforce never clamps its weight below (leave eps_low unset, "
                "or use policy_loss cispo for a lower bound)"
            )
        return self


class EvalConfig(Model):
    every: int = Field(0, ge=0)
    """Evaluate on the task's held-out split every N versions (versions 0, N, 2N, ... and the final
    one) with the evaluator stage; 0 = no evaluation."""
    max_problems: int | None = Field(None, ge=1)
    """Evaluate the first N problems of the held-out split (None: all of it)."""
    greedy: bool = True
    """Greedy decoding (temperature 0): pass@1."""
    samples: int = Field(0, ge=0)
    """k samples per problem at `temperature`: sampled pass@1 and pass@k (0 = none)."""
    temperature: float = Field(1.0, gt=0)
    """Temperature of the k samples."""
    max_tokens: int | None = Field(None, ge=1)
    """Completion tokens per model call (None: `actor.sampling.max_tokens`)."""
    concurrency: int = Field(32, ge=1)
    """Requests in flight at once (per evaluation, across the servers)."""
    pin: bool = True
    """Pin evaluated versions: the trainer holds the push of the version after a due one until that
    one's evaluation is published (at most `timeout_s`), so every evaluation samples exactly its
    version (off-version tokens 0), at the cost of a pause per evaluation (generation goes on with
    the evaluated weights meanwhile). False: training never waits; the evaluator measures the
    fraction of tokens sampled by later versions."""
    timeout_s: float = Field(120.0, gt=0)
    """Longest wait for one evaluation: the trainer's hold (`pin`), and the launcher's wait for the
    final version's evaluation before it stops the run."""

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        if self.every and not self.greedy and not self.samples:
            raise ValueError("eval: set greedy: true or samples > 0 (nothing to evaluate)")
        return self

    def sampling(self, base: SamplingConfig, greedy: bool) -> SamplingConfig:
        """The sampling of eval requests: greedy, or at `temperature`; the rest from `base`."""
        return base.model_copy(
            update={
                "temperature": 0.0 if greedy else self.temperature,
                "top_p": 1.0,
                "top_k": 0,
                "max_tokens": self.max_tokens or base.max_tokens,
            }
        )


class TrackConfig(Model):
    to: list[Literal["wandb", "mlflow", "tensorboard"]] = Field(default_factory=list)
    """Experiment trackers the launcher feeds while the run goes (a `stream-rl track --follow`
    child); `stream-rl track --run R --to ...` backfills a finished run the same way."""
    mlflow_uri: str | None = None
    """MLflow tracking URI (None: $MLFLOW_TRACKING_URI, else MLflow's default `./mlruns`)."""
    mlflow_experiment: str = "stream-rl"
    """MLflow experiment the run is logged in."""
    wandb_project: str = "stream-rl"
    """W&B project."""
    wandb_mode: Literal["online", "offline"] = "offline"
    """W&B mode: `offline` writes the run under `wandb_dir` (`wandb sync` uploads it later)."""
    wandb_dir: str | None = None
    """Where W&B writes (None: `runs/<run>/`)."""
    tensorboard_dir: str | None = None
    """TensorBoard event files (None: `runs/<run>/tensorboard/`)."""


class LauncherConfig(Model):
    restart: bool = False
    """Restart a stage that dies instead of stopping the run."""
    max_restarts: int = Field(3, ge=0)
    """Restarts per stage before the run is stopped."""
    actors: int = Field(1, ge=1)
    """Actor processes (consumer group members)."""
    verifiers: int = Field(1, ge=1)
    """Verifier processes."""
    preprocessors: int = Field(1, ge=1)
    """Preprocessor processes."""
    max_wall_s: float | None = Field(None, gt=0)
    """Stop the run after this many seconds."""
    stall_timeout_s: float | None = Field(300.0, gt=0)
    """Progress watchdog: no new weight version for this long while the stages are alive stops the
    run with an error naming the stuck stage (with `restart`, the stuck stage is restarted once
    first). None: off."""
    keep_broker: bool = False
    """Leave the local broker the launcher started running after the run (its data stays on disk
    either way; `stream-rl kafka up` brings it back for replay)."""
    fork_stages: Literal["auto", "off"] = "auto"
    """`auto`: on a CPU run (`trainer.device` and `inference.device` both `cpu`), the `stream-rl`
    stages and built-in servers are forked from one process that has imported torch and
    transformers once (`stream_rl/run/forkserver.py`), not started as programs that each import them
    (~6.5 s of CPU per trainer or server on 2 cores). `off`: every child is its own program (as on
    GPU runs always; `ps` then shows each child's own command line)."""
    autoscale: AutoscaleConfig = Field(default_factory=AutoscaleConfig)
    """Resize servers and stages from lag and occupancy during the run (off by default;
    `stream_rl/config/autoscale.py`, docs/autoscaling.md)."""
