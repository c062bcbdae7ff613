"""Run configuration: one pydantic model per stage, composed into `RunConfig`, loaded from YAML.

Every model forbids unknown keys, so a typo is an error that names the key. CLI overrides
use dotted paths: `--set trainer.lr=1e-5 --set actor.group_size=4` (values parsed as YAML).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from stream_rl.errors import ConfigError

DEFAULT_PREFIX = "stream-rl"
BOOTSTRAP_ENV = "STREAM_RL_KAFKA_BOOTSTRAP"
ADMIN_TOKEN_ENV = "STREAM_RL_ADMIN_TOKEN"


class Model(BaseModel):
    """Base for every config model: unknown keys are errors, defaults are validated."""

    model_config = ConfigDict(extra="forbid", validate_default=True, use_attribute_docstrings=True)


class KafkaConfig(Model):
    bootstrap: str | None = None
    """Bootstrap servers (`host:port,...`). None: the launcher starts (or reuses) the local broker;
    stages fall back to $STREAM_RL_KAFKA_BOOTSTRAP."""
    prefix: str = DEFAULT_PREFIX
    """Topic namespace: topics are named `<prefix>.<run>.<topic>`."""
    data_dir: str = ".kafka"
    """Data directory of the local broker (logs, pid, port), relative to the working directory."""
    port: int = Field(9092, ge=1, le=65535)
    """Port of the local broker (the controller listens on port + 1)."""
    partitions: int | None = Field(None, ge=1)
    """Override the partition count of every data topic (topology default otherwise)."""

    def resolved_bootstrap(self) -> str:
        """The bootstrap address: config, then environment, then the local broker's default."""
        return self.bootstrap or os.environ.get(BOOTSTRAP_ENV) or f"127.0.0.1:{self.port}"


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
    """Parameter dtype of the trainer and the built-in engine."""


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


class ServerConfig(Model):
    url: str
    """Base URL of an inference server, e.g. `http://127.0.0.1:8001`."""


class InferenceConfig(Model):
    num_servers: int = Field(1, ge=0)
    """Built-in servers the launcher starts (0 when `servers` points at running ones)."""
    servers: list[ServerConfig] = Field(default_factory=list)
    """Servers already running; when set, the launcher starts none."""
    host: str = "127.0.0.1"
    """Bind address of launched servers."""
    base_port: int = Field(8100, ge=1, le=65535)
    """First port of launched servers (server i listens on base_port + i)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Device of the built-in engine."""
    engine: Literal["builtin", "vllm", "sglang"] = "builtin"
    """Inference engine; vllm and sglang are GPU-only and unverified here."""
    max_batch: int = Field(64, ge=1)
    """Maximum sequences decoded together (continuous batching)."""
    kv_policy: Literal["keep", "recompute"] = "keep"
    """After an in-flight update: keep the old-weight KV cache (PipelineRL) or recompute it."""
    admin_token: SecretStr | None = Field(
        default_factory=lambda: SecretStr(t) if (t := os.environ.get(ADMIN_TOKEN_ENV)) else None
    )
    """Bearer token required by `/weights/*` when set (default: $STREAM_RL_ADMIN_TOKEN). Never
    written into run directories: the launcher passes it to its children in the environment."""
    torch_threads: int = Field(1, ge=1)
    """torch intra-op threads per server process."""
    weights_timeout_s: float = Field(60.0, gt=0)
    """Timeout of the weight-sync group's collectives on the server side (join, each update)."""
    seed: int | None = None
    """Seed of the sampling of requests that carry no seed (None: fresh entropy per server start)."""


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
    """Admission: how often the actor group's committed offsets, DLQ count and live members are
    re-read (the other actors' progress; one actor needs none of it after start)."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Sampling parameters of training rollouts."""


class VerifierConfig(Model):
    timeout_s: float = Field(5.0, gt=0)
    """Per-sample scoring timeout; a timeout becomes the verdict `timeout`."""
    workers: int = Field(1, ge=0)
    """Scoring processes (0 = score in the stage process, without timeouts enforcement by kill)."""
    batch_size: int = Field(64, ge=1)
    """Records scored per poll."""


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
    dedupe_window: int = Field(10000, ge=1)
    """Closed groups remembered per partition (in the state topic) to drop late duplicates."""
    max_batch_bytes: int = Field(1_000_000, ge=4096)
    """Encoded size limit of one TrainingBatch record; a larger pack is split."""


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
    policy_loss: Literal["reinforce", "ppo"] = "reinforce"
    """`reinforce`: truncated IS (PipelineRL default). `ppo`: clipped surrogate."""
    eps_low: float = Field(0.02, ge=0)
    """PPO lower clip."""
    eps_high: float = Field(0.02, ge=0)
    """Truncation of the IS weight (reinforce) / PPO upper clip."""
    kl_coef: float = Field(0.0, ge=0)
    """k3 KL to the reference (initial) model."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus coefficient."""
    overlong_filtering: bool = False
    """Zero the loss of sequences that hit max_tokens."""
    checkpoint_every: int = Field(0, ge=0)
    """Checkpoint every N steps (0 = only on stop)."""
    checkpoint_dir: str | None = None
    """Checkpoint directory (default `runs/<run>/trainer/checkpoints`)."""
    deterministic: bool = True
    """Deterministic CPU kernels: the same batches give bit-identical weights."""
    seed: int = 0
    """Torch seed of the trainer."""
    bucket_mb: float = Field(16.0, gt=0)
    """Weight broadcast bucket size (MiB)."""
    update_timeout_s: float = Field(60.0, gt=0)
    """A server that has not installed a version within this is taken out of routing."""
    backend: Literal["torch", "deepspeed"] = "torch"
    """Trainer backend: plain torch (CPU or one GPU) or DeepSpeed ZeRO (GPU, unverified here)."""
    zero_stage: Literal[2, 3] = 3
    """ZeRO stage of the deepspeed backend (2: optimizer state and gradients partitioned;
    3: parameters too)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Trainer device."""
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
    keep_checkpoints: int = Field(2, ge=1)
    """Checkpoints kept on disk (the oldest are deleted after a new one is durable)."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Serve Prometheus `/metrics` on this port (0 = any free port; None = off)."""


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
    keep_broker: bool = False
    """Leave the local broker the launcher started running after the run (its data stays on disk
    either way; `stream-rl kafka up` brings it back for replay)."""


class RunConfig(Model):
    run: str = Field("default", pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
    """Run name: the topic namespace and `runs/<run>/`."""
    mode: Literal["pipeline", "conventional"] = "pipeline"
    """`pipeline`: in-flight updates, admission bounded by max_lag. `conventional`: one step's worth
    of samples per version, updates only between batches (the paper's baseline)."""
    in_flight_updates: bool = True
    """Update weights while sequences decode (PipelineRL). False: the servers the launcher starts
    (`stream-rl serve --swap-policy between_sequences`) hold admission once an update arrives, let
    the running sequences finish on the old weights, then install it, so every sequence is sampled
    by one version; the trainer's push waits for that drain. Servers in `inference.servers` are
    started by the user, with the flag of their choice."""
    seed: int = 0
    """Global seed (loader order, sampling)."""
    runs_dir: str = "runs"
    """Where runs write configs, logs, checkpoints, plots."""
    kafka: KafkaConfig = Field(default_factory=KafkaConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    loader: LoaderConfig = Field(default_factory=LoaderConfig)
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    verifier: VerifierConfig = Field(default_factory=VerifierConfig)
    preprocessor: PreprocessorConfig = Field(default_factory=PreprocessorConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    launcher: LauncherConfig = Field(default_factory=LauncherConfig)

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        if self.mode == "conventional" and self.trainer.samples_per_step % self.actor.group_size:
            raise ValueError(
                "trainer.samples_per_step must be a multiple of actor.group_size in conventional mode"
            )
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / self.run


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`["a.b=1", "c=x"]` -> `{"a": {"b": 1}, "c": "x"}`; values are parsed as YAML scalars."""
    out: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set trainer.lr=1e-5")
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {part} is set twice")
        node[parts[-1]] = yaml.safe_load(raw) if raw else ""
    return out


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Recursively merge `update` into a copy of `base`."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def format_validation_error(exc: ValidationError, source: str) -> str:
    """One line per problem: `source: key.path: message (got value)`."""
    lines = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"]) or "<root>"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; see configs/ for examples)"
        got = err.get("input")
        suffix = (
            ""
            if err["type"] in ("extra_forbidden", "missing") or isinstance(got, dict)
            else f" (got {got!r})"
        )
        lines.append(f"{source}: {path}: {msg}{suffix}")
    return "\n".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a run config from YAML (or defaults when path is None) and apply `--set` overrides."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        data = loaded
    if overrides:
        data = deep_merge(data, parse_overrides(overrides))
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from exc


def dump_config(config: RunConfig) -> str:
    """The resolved config as YAML, as written into run directories. Secrets are left out (they
    travel in the environment), so the file reloads to the same config minus the secret."""
    data = config.model_dump(mode="json")
    data["inference"]["admin_token"] = None
    return yaml.safe_dump(data, sort_keys=False)
