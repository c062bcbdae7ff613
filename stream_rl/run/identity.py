"""Run identity: what starting run R means when R already exists.

A run is its name: the topics `<prefix>.<R>.*` (the lineage on `weight-versions` is the record of
what was trained) and the directory `runs/<R>/` (its config, checkpoints, timeline, summary).
`stream-rl run` decides, before it starts anything, from both:

- **new**: neither the run directory nor the broker knows R -> start it.
- **never trained**: the directory exists but no version was ever published (a launch that failed
  before the trainer's version 0) -> start it again with the new config.
- **resume**: the lineage has versions but no `final` one -> resume it with its recorded config
  (`runs/<R>/config.yaml`); a config that differs in anything but the operational keys below
  is refused with the keys that differ.
- **finished**: the lineage holds a `final` version -> refused with one line: where its summary
  is and how to start another (`--set run=<new name>`).
- the directory and the broker disagree (the directory has a lineage the broker lacks: another
  broker or a wiped data dir; or the broker has versions for R but there is no directory) ->
  refused with one line saying which broker and which directory.

Operational keys (ports, addresses, the launcher's supervision, timeouts, thread counts) may
change on a resume: they do not change what is trained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml

from stream_rl.config import RunConfig
from stream_rl.contracts import WeightVersion, WeightVersionKind
from stream_rl.errors import ConfigError, StreamRLError

# Keys (dotted prefixes) that may differ between a run's recorded config and its resume.
OPERATIONAL = (
    "kafka.bootstrap",
    "kafka.port",
    "inference.host",
    "inference.base_port",
    "inference.servers",
    "inference.admin_token",
    "inference.api_key",
    "inference.torch_threads",
    "inference.weights_timeout_s",
    "actor.concurrency_per_server",
    "actor.request_timeout_s",
    "actor.max_retries",
    "actor.backoff_s",
    "actor.backoff_max_s",
    "actor.dead_cooldown_s",
    "actor.refresh_s",
    "trainer.metrics_port",
    "trainer.sync_master_port",
    "trainer.sync_master_addr",
    "trainer.connect_timeout_s",
    "trainer.update_timeout_s",
    "launcher",
    "track",
    "eval.timeout_s",
    "eval.concurrency",
)


class RunState(StrEnum):
    NEW = "new"
    NEVER_TRAINED = "never trained"
    RESUME = "resume"
    FINISHED = "finished"


@dataclass
class Identity:
    state: RunState
    last_version: int | None = None
    message: str = ""
    """What the launcher prints before it starts (empty for a new run)."""


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: data}


def _operational(key: str) -> bool:
    return any(key == p or key.startswith(p + ".") for p in OPERATIONAL)


def config_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`key: recorded -> current` for every non-operational key whose value differs."""
    a, b = _flatten(recorded), _flatten(current)
    out = []
    # A key the record lacks had its default then (the record predates it): not a difference.
    for key in sorted(a):
        if _operational(key):
            continue
        if a.get(key) != b.get(key):
            out.append(f"{key}: {a.get(key)!r} -> {b.get(key)!r}")
    return out


def recorded_config(run_dir: Path) -> dict[str, Any] | None:
    """The run's recorded config: the trainer's record (written once, at its first start), else
    the launcher's `config.yaml`."""
    for path in (run_dir / "trainer" / "record" / "config.yaml", run_dir / "config.yaml"):
        if path.is_file():
            data = yaml.safe_load(path.read_text())
            return data if isinstance(data, dict) else None
    return None


def _dir_versions(run_dir: Path) -> int | None:
    """The last version the run directory says was trained (summary or timeline), if any."""
    summary = run_dir / "summary.json"
    if summary.is_file():
        try:
            last = json.loads(summary.read_text()).get("versions", {}).get("last")
        except ValueError:
            last = None
        if isinstance(last, int):
            return last
    ckpts = run_dir / "trainer" / "checkpoints" / "latest"
    return 0 if ckpts.is_file() else None


def decide(config: RunConfig, lineage: list[WeightVersion], bootstrap: str) -> Identity:
    """What starting `config.run` means (see the module docstring); raises StreamRLError with one
    line when it must not start."""
    run, run_dir = config.run, config.run_dir
    has_dir = (run_dir / "config.yaml").is_file()
    start_again = f"start another with --set run=<new name> (e.g. --set run={run}-2; for the demo: make demo RUN={run}-2)"
    if not lineage:
        dir_last = _dir_versions(run_dir) if has_dir else None
        if dir_last is not None:
            raise StreamRLError(
                f"run {run}: {run_dir} records {dir_last} trained versions but the broker at {bootstrap} "
                f"has no weight-versions for it (another broker, or its data dir was removed): start the "
                f"broker that holds it (`stream-rl kafka up --data-dir {config.kafka.data_dir} --port "
                f"{config.kafka.port}`), or {start_again}"
            )
        if has_dir:
            return Identity(
                RunState.NEVER_TRAINED, None, f"run {run} never trained (no version published): starting it"
            )
        return Identity(RunState.NEW)
    last = max(lineage, key=lambda wv: wv.version)
    if not has_dir:
        raise StreamRLError(
            f"run {run}: the broker at {bootstrap} holds {last.version} versions of it but {run_dir} does "
            f"not exist: pass the runs_dir it was started with (--set runs_dir=...), or {start_again}"
        )
    if any(wv.kind == WeightVersionKind.FINAL for wv in lineage):
        summary = run_dir / "summary.json"
        raise StreamRLError(
            f"run {run} has finished ({last.version} versions); its summary is {summary}; {start_again}"
        )
    recorded = recorded_config(run_dir)
    if recorded is None:
        raise StreamRLError(f"run {run}: {run_dir} has no recorded config to resume with; {start_again}")
    diff = config_differences(recorded, _comparable(config))
    if diff:
        raise ConfigError(
            f"run {run} is unfinished (version {last.version}) and resumes only with its recorded config "
            f"({run_dir / 'config.yaml'}); these keys differ: {'; '.join(diff)}; {start_again}"
        )
    return Identity(
        RunState.RESUME,
        last.version,
        f"resuming run {run} at version {last.version} of {config.trainer.max_steps} "
        f"(its recorded config; a summary at the end covers what this invocation trains)",
    )


def _comparable(config: RunConfig) -> dict[str, Any]:
    from stream_rl.config import dump_config

    data: dict[str, Any] = yaml.safe_load(dump_config(config))
    return data
