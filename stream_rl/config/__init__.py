"""Run configuration: one pydantic model per stage, composed into `RunConfig`, loaded from YAML.

Every model forbids unknown keys, so a typo is an error that names the key. CLI overrides
use dotted paths: `--set trainer.lr=1e-5 --set actor.group_size=4` (values parsed as YAML).

Split by role: `base` (the model base, environment names), `kafka`, `inference`, `stages` (the
other sections), `run` (`RunConfig` and its cross-section checks), `loading` (YAML, overrides,
errors, dump). Import from `stream_rl.config`.
"""

from __future__ import annotations

from stream_rl.config.base import ADMIN_TOKEN_ENV, BOOTSTRAP_ENV, DEFAULT_PREFIX, Model
from stream_rl.config.inference import (
    ENGINES,
    InferenceConfig,
    ServerConfig,
    SGLangConfig,
    VLLMConfig,
    normalize_url,
)
from stream_rl.config.kafka import RESERVED_KAFKA_PROPERTIES, KafkaConfig, resolve_secret
from stream_rl.config.loading import (
    deep_merge,
    dump_config,
    format_validation_error,
    load_config,
    parse_overrides,
)
from stream_rl.config.run import RunConfig, flash_attention_problem
from stream_rl.config.stages import (
    ActorConfig,
    EvalConfig,
    LauncherConfig,
    LoaderConfig,
    LoraConfig,
    ModelConfig,
    PreprocessorConfig,
    SamplingConfig,
    TaskConfig,
    TrackConfig,
    TrainerConfig,
    VerifierConfig,
)

__all__ = [
    "ADMIN_TOKEN_ENV",
    "BOOTSTRAP_ENV",
    "DEFAULT_PREFIX",
    "ENGINES",
    "RESERVED_KAFKA_PROPERTIES",
    "ActorConfig",
    "EvalConfig",
    "InferenceConfig",
    "KafkaConfig",
    "LauncherConfig",
    "LoaderConfig",
    "LoraConfig",
    "Model",
    "ModelConfig",
    "PreprocessorConfig",
    "RunConfig",
    "SGLangConfig",
    "SamplingConfig",
    "ServerConfig",
    "TaskConfig",
    "TrackConfig",
    "TrainerConfig",
    "VLLMConfig",
    "VerifierConfig",
    "deep_merge",
    "dump_config",
    "flash_attention_problem",
    "format_validation_error",
    "load_config",
    "normalize_url",
    "parse_overrides",
    "resolve_secret",
]
