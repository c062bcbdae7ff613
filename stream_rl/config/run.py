"""`RunConfig`: every section composed, and the checks that span sections."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from stream_rl.config.autoscale import autoscale_problem
from stream_rl.config.base import Model
from stream_rl.config.inference import InferenceConfig
from stream_rl.config.kafka import KafkaConfig
from stream_rl.config.stages import (
    ActorConfig,
    EvalConfig,
    LauncherConfig,
    LoaderConfig,
    ModelConfig,
    PreprocessorConfig,
    TaskConfig,
    TrackConfig,
    TrainerConfig,
    VerifierConfig,
)


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
        if inf.decode_shape != "running" and (inf.servers or inf.engine != "builtin"):
            raise ValueError(
                "inference.decode_shape applies to the built-in servers the launcher starts (start your own "
                "with `stream-rl serve --decode-shape fixed`; vLLM and SGLang pad to their CUDA graphs themselves)"
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
        problem = push_problem(self)
        if problem:
            raise ValueError(problem)
        problem = autoscale_problem(self)
        if problem:
            raise ValueError(problem)
        return self

    @property
    def lag_bound(self) -> int:
        """The most versions a trained sample may lag: 0 in conventional mode, else `actor.max_lag`."""
        return 0 if self.mode == "conventional" else self.actor.max_lag

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / self.run


def push_problem(config: RunConfig) -> str | None:
    """Why `trainer.push_dtype`, `trainer.push_delta_threshold` or `inference.dtype` cannot apply
    (None: they can); docs/weight-pushes.md."""
    tcfg, inf = config.trainer, config.inference
    engines = {s.engine for s in inf.server_list()}
    shaped = tcfg.push_dtype != "trainer" or tcfg.push_delta_threshold is not None
    if inf.dtype is not None and (inf.servers or inf.engine != "builtin"):
        return "inference.dtype applies to the built-in servers the launcher starts (start your own with --dtype)"
    if shaped and engines - {"builtin"}:
        return (
            "trainer.push_dtype: server and trainer.push_delta_threshold apply to built-in servers only "
            "(vLLM and SGLang servers take the trainer's tensors)"
        )
    if shaped and (
        tcfg.weight_transport == "cuda_ipc" or (tcfg.weight_transport == "auto" and tcfg.device == "cuda")
    ):
        return (
            "trainer.push_dtype: server and trainer.push_delta_threshold need trainer.weight_transport "
            "gloo or nccl (cuda_ipc shares the trainer's own buffers)"
        )
    if inf.dtype not in (None, config.model.dtype) and tcfg.push_dtype == "trainer" and engines:
        return (
            f"inference.dtype {inf.dtype} differs from model.dtype {config.model.dtype}: the servers would "
            "refuse the trainer's tensors; set trainer.push_dtype: server (cast on the wire)"
        )
    return None


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
