"""Run configuration: one pydantic model per stage, composed into `RunConfig`, loaded from YAML.

Every model forbids unknown keys, so a typo is an error that names the key. CLI overrides
use dotted paths: `--set trainer.lr=1e-5 --set actor.group_size=4` (values parsed as YAML).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from stream_rl.errors import ConfigError

DEFAULT_PREFIX = "stream-rl"
BOOTSTRAP_ENV = "STREAM_RL_KAFKA_BOOTSTRAP"
ADMIN_TOKEN_ENV = "STREAM_RL_ADMIN_TOKEN"


class Model(BaseModel):
    """Base for every config model: unknown keys are errors, defaults are validated."""

    model_config = ConfigDict(extra="forbid", validate_default=True, use_attribute_docstrings=True)


RESERVED_KAFKA_PROPERTIES = {
    "bootstrap.servers": "set kafka.bootstrap",
    "compression.type": "set kafka.compression",
    "client.id": "stream-rl names every client after its stage and instance",
    "group.id": "groups are named <prefix>.<run>.<role>",
    "group.instance.id": "set by --instance",
    "transactional.id": "set per stage instance",
    "enable.idempotence": "stream-rl's producers are always idempotent",
    "acks": "stream-rl's producers always use acks=all",
    "enable.auto.commit": "stages commit after their output is durable",
    "enable.auto.offset.store": "stages commit after their output is durable",
    "isolation.level": "consumers read committed records only",
}
"""librdkafka properties the stages' guarantees rest on, with the reason each is refused."""

SECRET_MARKERS = ("password", "secret", "ssl.key.pem", "sasl.oauthbearer.config", "ssl_key")


def _is_secret_key(key: str) -> bool:
    return any(marker in key for marker in SECRET_MARKERS)


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """`{security: {protocol: X}}` -> `{"security.protocol": X}`: `--set kafka.client_properties.
    security.protocol=X` (dotted override paths) and nested YAML both give librdkafka's flat keys."""
    if not isinstance(value, dict):
        return {prefix: value} if prefix else {}
    out: dict[str, Any] = {}
    for key, item in value.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(item, dict):
            out.update(_flatten(item, name))
        else:
            out[name] = item
    return out


def resolve_secret(ref: str, key: str) -> SecretStr:
    """The value a secret reference names: `${NAME}` (an environment variable) or `file:PATH` (the
    file's content, trailing newline stripped). One-line ConfigError naming `key` otherwise."""
    if ref.startswith("${") and ref.endswith("}"):
        name = ref[2:-1]
        value = os.environ.get(name)
        if not value:
            raise ConfigError(f"{key}: environment variable {name} is not set (the config names it: {ref})")
        return SecretStr(value)
    path = Path(ref.removeprefix("file:"))
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read secret file {path}: {exc.strerror}") from exc
    return SecretStr(text.rstrip("\r\n"))


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
    compression: Literal["none", "lz4", "zstd", "gzip", "snappy"] = "zstd"
    """Compression of every record the stages produce (the broker decompresses each batch to
    validate it: its CPU cost per batch; see README Performance)."""
    outage_timeout_s: float = Field(120.0, gt=0)
    """How long every client waits out a broker that stopped answering (a restart) before failing
    with an error; a broker that never answered fails within 10 s."""
    replication_factor: int | None = Field(None, ge=1)
    """Copies of every partition of the run's topics (None: the topology's, 1). On a cluster use 3
    with `min_insync_replicas: 2`: one broker can then fail without losing an acknowledged record."""
    min_insync_replicas: int | None = Field(None, ge=1)
    """Replicas that must hold a record before the (acks=all) producer is told it is written
    (None: the topology's, 1). Must not exceed the replication factor, or every write fails."""

    client_properties: dict[str, str] = Field(default_factory=dict)
    """librdkafka properties given to every Kafka client of every process (stages, trainer,
    launcher, `status`, `lag`, `replay`, ...), e.g. `security.protocol: SASL_SSL`, `sasl.mechanism`,
    `sasl.username`, `ssl.ca.location`. Secrets are refused here (use `secret_properties`), as are
    the properties stream-rl's guarantees rest on (acks, idempotence, ...)."""
    secret_properties: dict[str, str] = Field(default_factory=dict)
    """librdkafka properties whose values are secrets (`sasl.password`, `ssl.key.password`, ...),
    each given as a reference: `${NAME}` (an environment variable) or `file:PATH` (the file's
    content). Run directories and logs hold the reference only; each process reads the value
    (as a `SecretStr`) when it opens its Kafka clients."""

    @field_validator("client_properties", "secret_properties", mode="before")
    @classmethod
    def _flat(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        flat = _flatten(value)
        # librdkafka takes strings; YAML gives true/30000: its spelling of them.
        return {
            k: (str(v).lower() if isinstance(v, bool) else str(v) if isinstance(v, int | float) else v)
            for k, v in flat.items()
        }

    @model_validator(mode="after")
    def _check_properties(self) -> KafkaConfig:
        for field, props in (
            ("client_properties", self.client_properties),
            ("secret_properties", self.secret_properties),
        ):
            for key in props:
                if key in RESERVED_KAFKA_PROPERTIES:
                    raise ValueError(
                        f"kafka.{field}: {key} is not settable ({RESERVED_KAFKA_PROPERTIES[key]})"
                    )
        for key in self.client_properties:
            if _is_secret_key(key):
                raise ValueError(
                    f"kafka.client_properties: {key} holds a secret: put it in kafka.secret_properties "
                    "as ${ENV_VAR} or file:PATH"
                )
            if key in self.secret_properties:
                raise ValueError(f"kafka: {key} is in both client_properties and secret_properties")
        for key, ref in self.secret_properties.items():
            if not ((ref.startswith("${") and ref.endswith("}") and len(ref) > 3) or ref.startswith("file:")):
                raise ValueError(
                    f"kafka.secret_properties: {key}: give a reference, ${{ENV_VAR}} or file:PATH, "
                    "never the secret itself (configs are copied into run directories)"
                )
        return self

    def librdkafka_properties(self) -> dict[str, str | SecretStr]:
        """`client_properties` plus the secrets, read now from the environment or their files
        (ConfigError naming the key when one is missing)."""
        props: dict[str, str | SecretStr] = dict(self.client_properties)
        for key, ref in self.secret_properties.items():
            props[key] = resolve_secret(ref, f"kafka.secret_properties.{key}")
        return props

    @model_validator(mode="after")
    def _check_replication(self) -> KafkaConfig:
        rf, isr = self.replication_factor, self.min_insync_replicas
        if rf is not None and isr is not None and isr > rf:
            raise ValueError(
                f"kafka.min_insync_replicas ({isr}) must not exceed kafka.replication_factor ({rf})"
            )
        return self

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


ENGINES = ("builtin", "vllm", "sglang")
Engine = Literal["builtin", "vllm", "sglang"]


def normalize_url(url: str) -> str:
    """The one spelling of a server's base URL (no trailing `/`): rollouts' `server_id`, the
    trainer's `servers_updated` and routing all name a server by it."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")) or url[-3:] == "://":
        raise ValueError(f"expected a base URL like http://host:port, got {url!r}")
    return url


class ServerConfig(Model):
    url: str
    """Base URL of an inference server, e.g. `http://127.0.0.1:8001` (a trailing `/` is dropped)."""
    engine: Engine | None = None
    """The server's engine (None: `inference.engine`)."""

    @field_validator("url")
    @classmethod
    def _normalize(cls, value: str) -> str:
        return normalize_url(value)


class VLLMConfig(Model):
    """How the launcher starts vLLM servers (`inference.engine: vllm`), and how the trainer talks
    to them. README "Engines" lists the flags and why."""

    python: str | None = None
    """Python of the vLLM environment (None: `.venv-vllm/bin/python` if it exists, from `make vllm`,
    else `python3`)."""
    weight_transfer: Literal["auto", "stream_rl_gloo", "nccl"] = "auto"
    """vLLM weight-transfer backend: `stream_rl_gloo` (our plugin, CPU), `nccl` (vLLM's, GPU);
    `auto` picks by `inference.device`."""
    max_model_len: int | None = Field(None, ge=16)
    """`--max-model-len` (None: the model's own maximum)."""
    kv_cache_gib: int = Field(1, ge=1)
    """CPU only: the KV cache size (`VLLM_CPU_KVCACHE_SPACE`, GiB)."""
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """GPU only: `--gpu-memory-utilization` (None: vLLM's default)."""
    pause_lease_s: float = Field(120.0, gt=0)
    """A server paused by a trainer that never resumes it resumes itself after this
    (`stream_rl.weights.vllm_guard`)."""
    startup_timeout_s: float = Field(600.0, gt=0)
    """How long the launcher waits for a vLLM server to answer /health (CPU start-up takes minutes)."""
    extra_args: list[str] = Field(default_factory=list)
    """More `vllm serve` arguments, passed as they are."""


class SGLangConfig(Model):
    """How the launcher starts SGLang servers (`inference.engine: sglang`, CUDA only; unverified)."""

    python: str | None = None
    """Python of the SGLang environment (None: `python3`)."""
    startup_timeout_s: float = Field(600.0, gt=0)
    """How long the launcher waits for an SGLang server to answer /health."""
    extra_args: list[str] = Field(default_factory=list)
    """More `sglang.launch_server` arguments, passed as they are."""


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
    engine: Engine = "builtin"
    """Inference engine of the launched servers (and of `servers` that name none): `builtin`
    (stream-rl's own), `vllm` (CPU build verified, GPU unverified), `sglang` (GPU, unverified)."""
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    """vLLM servers (`engine: vllm`)."""
    sglang: SGLangConfig = Field(default_factory=SGLangConfig)
    """SGLang servers (`engine: sglang`)."""
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

    def server_list(self) -> list[ServerConfig]:
        """The run's servers: `servers` when set, else the `num_servers` the launcher starts at
        `http://{host}:{base_port + i}`, each with its engine resolved."""
        if self.servers:
            return [ServerConfig(url=s.url, engine=s.engine or self.engine) for s in self.servers]
        return [
            ServerConfig(url=f"http://{self.host}:{self.base_port + i}", engine=self.engine)
            for i in range(self.num_servers)
        ]

    def server_urls(self) -> list[str]:
        return [s.url for s in self.server_list()]

    def vllm_backend(self) -> str:
        """The vLLM weight-transfer backend: `vllm.weight_transfer`, or by `device` when `auto`."""
        if self.vllm.weight_transfer != "auto":
            return self.vllm.weight_transfer
        return "nccl" if self.device == "cuda" else "stream_rl_gloo"


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
    worth; the trainer drops any that slip through (`trainer.dedupe_window`). The memory it costs
    is bounded by it (~150 bytes a group)."""
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
    update_timeout_s: float = Field(60.0, gt=0)
    """A server that has not installed a version within this is taken out of routing."""
    backend: Literal["torch", "deepspeed"] = "torch"
    """Trainer backend: plain torch (CPU or one GPU) or DeepSpeed ZeRO (GPU, unverified here)."""
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
    eval: EvalConfig = Field(default_factory=EvalConfig)
    track: TrackConfig = Field(default_factory=TrackConfig)
    launcher: LauncherConfig = Field(default_factory=LauncherConfig)

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        if self.mode == "conventional" and self.trainer.samples_per_step % self.actor.group_size:
            raise ValueError(
                "trainer.samples_per_step must be a multiple of actor.group_size in conventional mode"
            )
        inf = self.inference
        engines = {s.engine for s in inf.server_list()}
        if "sglang" in engines and inf.device != "cuda":
            raise ValueError(
                "inference.engine: sglang needs inference.device: cuda (SGLang has no CPU build that runs here)"
            )
        if "sglang" in engines and self.trainer.device != "cuda":
            raise ValueError(
                "inference.engine: sglang needs trainer.device: cuda (its weights travel over NCCL)"
            )
        tcfg = self.trainer
        if tcfg.weight_transport in ("nccl", "cuda_ipc") and tcfg.device != "cuda":
            raise ValueError(
                f"trainer.weight_transport: {tcfg.weight_transport} needs trainer.device: cuda (use gloo or auto on CPU)"
            )
        if tcfg.weight_transport != "auto" and engines and "builtin" not in engines:
            raise ValueError(
                "trainer.weight_transport applies to built-in servers only; set inference.vllm.weight_transfer for vLLM"
            )
        if tcfg.weight_transport in ("nccl", "cuda_ipc") and not inf.servers and inf.device != "cuda":
            raise ValueError(
                f"trainer.weight_transport: {tcfg.weight_transport} needs inference.device: cuda for launched servers"
            )
        if self.model.attn_implementation == "flash_attention_2":
            problem = flash_attention_problem(self.model.dtype, [tcfg.device, inf.device])
            if problem:
                raise ValueError(problem)
        if self.model.dtype == "float16" and tcfg.backend == "torch":
            raise ValueError(
                "model.dtype: float16 is not trained by trainer.backend: torch (no loss scaling); use bfloat16, or deepspeed"
            )
        if "vllm" in engines and inf.vllm_backend() == "nccl" and self.trainer.device != "cuda":
            raise ValueError(
                "inference.vllm.weight_transfer: nccl needs trainer.device: cuda (use stream_rl_gloo on CPU)"
            )
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / self.run


def flash_attention_problem(dtype: str, devices: list[str]) -> str | None:
    """Why `model.attn_implementation: flash_attention_2` cannot run here (None: it can)."""
    import importlib.util

    if importlib.util.find_spec("flash_attn") is None:
        return "model.attn_implementation: flash_attention_2 needs the flash-attn package, which is not installed (use sdpa)"
    if any(d != "cuda" for d in devices):
        return "model.attn_implementation: flash_attention_2 runs on CUDA only (use sdpa on CPU)"
    if dtype == "float32":
        return "model.attn_implementation: flash_attention_2 needs model.dtype bfloat16 or float16"
    return None


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
    # Left out, not null: the reloaded config then takes it from $STREAM_RL_ADMIN_TOKEN again.
    data["inference"].pop("admin_token", None)
    return yaml.safe_dump(data, sort_keys=False)
