"""`inference:`: the servers (launched or given), their engine and its options."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, SecretStr, field_validator

from stream_rl.config.base import ADMIN_TOKEN_ENV, Model
from stream_rl.config.kafka import resolve_secret
from stream_rl.errors import ConfigError

API_KEY_ENV = "VLLM_API_KEY"
"""The environment variable holding the OpenAI routes' key: vLLM reads it (as `--api-key`), the
built-in server and every client here too, so one variable serves both engines."""
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")

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
    to them. docs/engines.md "Engines" lists the flags and why."""

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
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Parameter dtype of the launched built-in engines (None: `model.dtype`). A bfloat16 engine for
    a float32 trainer needs `trainer.push_dtype: server` (the push casts; docs/weight-pushes.md)."""
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
    decode_shape: Literal["running", "fixed"] = "running"
    """Built-in engine: a decode step runs the model over the running sequences (`running`), or
    over all `max_batch` slots, idle ones padded and masked (`fixed`, as CUDA-graph engines pad to a
    captured batch): a step then costs the same at any occupancy, a memory-bound accelerator's
    cost curve emulated on a CPU (figures taken with it are an emulation of GPU economics)."""
    admin_token: SecretStr | None = Field(
        default_factory=lambda: SecretStr(t) if (t := os.environ.get(ADMIN_TOKEN_ENV)) else None
    )
    """Bearer token required by `/weights/*` when set (default: $STREAM_RL_ADMIN_TOKEN). Never
    written into run directories: the launcher passes it to its children in the environment."""
    api_key: str | None = None
    """The key the OpenAI routes (`/v1/*`) require as `Authorization: Bearer <key>`, given as a
    reference: `${ENV_VAR}` or `file:PATH`, never the key itself (configs are copied into run
    directories). None: $VLLM_API_KEY when set, else no key, and the launcher makes one per run
    when its servers listen beyond loopback. Distinct from `admin_token`: samplers (actors, the
    evaluator, outside clients) get this key, only the trainer gets the admin token."""
    torch_threads: int = Field(1, ge=1)
    """torch intra-op threads per server process."""
    weights_timeout_s: float = Field(60.0, gt=0)
    """Timeout of the weight-sync group's collectives on the server side (join, each update)."""
    seed: int | None = None
    """Seed of the sampling of requests that carry no seed (None: fresh entropy per server start)."""

    @field_validator("api_key")
    @classmethod
    def _api_key_reference(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.strip():
            raise ValueError("empty: give a reference, ${ENV_VAR} or file:PATH, or leave it out")
        if not (
            (value.startswith("${") and value.endswith("}") and len(value) > 3) or value.startswith("file:")
        ):
            raise ValueError(
                "give a reference, ${ENV_VAR} or file:PATH, never the key itself "
                "(configs are copied into run directories)"
            )
        return value

    def api_key_secret(self) -> SecretStr | None:
        """The OpenAI routes' key: `api_key`'s reference read now, else $VLLM_API_KEY, else None.
        One-line ConfigError when the reference names nothing or an empty value."""
        if self.api_key is None:
            value = os.environ.get(API_KEY_ENV)
            return SecretStr(value) if value else None
        secret = resolve_secret(self.api_key, "inference.api_key")
        if not secret.get_secret_value().strip():
            raise ConfigError(f"inference.api_key: {self.api_key} holds an empty key")
        return secret

    def listens_beyond_loopback(self) -> bool:
        """Whether launched servers bind an address other hosts can reach."""
        return self.host.strip("[]") not in LOOPBACK_HOSTS

    def launched_port(self, index: int) -> int:
        """The port of launched server `index` (`server-<index>`): `base_port + index`."""
        return self.base_port + index

    def launched_url(self, index: int) -> str:
        """The URL of launched server `index`."""
        return f"http://{self.host}:{self.launched_port(index)}"

    def server_list(self) -> list[ServerConfig]:
        """The run's servers: `servers` when set, else the `num_servers` the launcher starts
        (`launched_url`), each with its engine resolved."""
        if self.servers:
            return [ServerConfig(url=s.url, engine=s.engine or self.engine) for s in self.servers]
        return [ServerConfig(url=self.launched_url(i), engine=self.engine) for i in range(self.num_servers)]

    def server_urls(self) -> list[str]:
        return [s.url for s in self.server_list()]

    def vllm_backend(self) -> str:
        """The vLLM weight-transfer backend: `vllm.weight_transfer`, or by `device` when `auto`."""
        if self.vllm.weight_transfer != "auto":
            return self.vllm.weight_transfer
        return "nccl" if self.device == "cuda" else "stream_rl_gloo"
