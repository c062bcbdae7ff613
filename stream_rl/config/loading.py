"""A run config from YAML and `--set` overrides (one line per problem), and back to YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from stream_rl.config.run import RunConfig
from stream_rl.errors import ConfigError


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
