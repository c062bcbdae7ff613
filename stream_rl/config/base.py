"""The base of every config model, and the names the environment carries."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

DEFAULT_PREFIX = "stream-rl"
BOOTSTRAP_ENV = "STREAM_RL_KAFKA_BOOTSTRAP"
ADMIN_TOKEN_ENV = "STREAM_RL_ADMIN_TOKEN"


class Model(BaseModel):
    """Base for every config model: unknown keys are errors, defaults are validated."""

    model_config = ConfigDict(extra="forbid", validate_default=True, use_attribute_docstrings=True)
