"""Experiment-tracker sinks: Weights & Biases, MLflow, TensorBoard. Each gets the run's resolved
config once (`params`) and then one `log(version, metrics, wall_ms)` per weight version, in version
order, with flat metric names (`train/loss`, `eval/held-out/pass_at_1`, `lag/verifier`, ...):
`stream_rl/tools/track.py` builds them from the run's topics.

- W&B: `wandb.init(project, name=run, mode=...)` (`offline` writes `wandb/offline-run-*/` under
  the directory, synced later with `wandb sync`); every metric is plotted against `version`
  (`define_metric(step_metric="version")`), so a late evaluation never breaks step order.
- MLflow: one MLflow run named after the run in experiment `experiment`, on the tracking server
  at `uri` (`$MLFLOW_TRACKING_URI` otherwise); params are the flattened config (values cut at
  MLflow's 6000 characters), metrics `log_batch`-ed with step = version.
- TensorBoard: event files in the directory (`torch.utils.tensorboard.SummaryWriter`), scalars
  with step = version and their wall time; the config as one text summary.

The libraries are the optional `trackers` extra (`pip install -e '.[trackers]'`); a sink whose
library is missing is a one-line error naming the extra.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from stream_rl.errors import ConfigError

SINKS = ("wandb", "mlflow", "tensorboard")


class Sink(Protocol):
    def params(self, params: dict[str, Any]) -> None: ...

    def log(self, version: int, metrics: dict[str, float], wall_ms: int) -> None: ...

    def close(self) -> None: ...


def _missing(library: str, exc: ImportError) -> ConfigError:
    return ConfigError(f"--to: the {library} sink needs {library} (pip install -e '.[trackers]'): {exc}")


class WandbSink:
    def __init__(self, run: str, project: str, directory: Path, mode: str) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise _missing("wandb", exc) from exc
        directory.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=project,
            name=run,
            dir=str(directory),
            mode="offline" if mode == "offline" else "online",
            reinit="create_new",
        )
        self._run.define_metric("version")
        self._run.define_metric("*", step_metric="version")

    @property
    def run_dir(self) -> Path:
        return Path(self._run.dir).parent

    def params(self, params: dict[str, Any]) -> None:
        self._run.config.update(params, allow_val_change=True)

    def log(self, version: int, metrics: dict[str, float], wall_ms: int) -> None:
        self._run.log({"version": version, **metrics})

    def close(self) -> None:
        self._run.finish()


class MlflowSink:
    MAX_PARAM = 6000

    def __init__(self, run: str, experiment: str, uri: str | None) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise _missing("mlflow", exc) from exc
        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id: str = self.client.create_run(
            experiment_id, run_name=run, tags={"stream_rl.run": run}
        ).info.run_id

    def params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, json.dumps(v) if not isinstance(v, str) else v) for k, v in sorted(params.items())]
        items = [Param(p.key, p.value[: self.MAX_PARAM]) for p in items]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log(self, version: int, metrics: dict[str, float], wall_ms: int) -> None:
        from mlflow.entities import Metric

        items = [Metric(k, float(v), wall_ms, version) for k, v in sorted(metrics.items())]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i : i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class TensorboardSink:
    def __init__(self, directory: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise _missing("tensorboard", exc) from exc
        directory.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(directory))

    def params(self, params: dict[str, Any]) -> None:
        text = "\n".join(f"    {k}: {json.dumps(v)}" for k, v in sorted(params.items()))
        self.writer.add_text("config", text, 0)

    def log(self, version: int, metrics: dict[str, float], wall_ms: int) -> None:
        for k, v in sorted(metrics.items()):
            self.writer.add_scalar(k, float(v), version, walltime=wall_ms / 1000)

    def close(self) -> None:
        self.writer.close()


def open_sink(kind: str, run: str, options: dict[str, Any]) -> Sink:
    """The sink `kind` for run `run`; `options`: wandb_project, wandb_dir, wandb_mode, mlflow_uri,
    mlflow_experiment, tensorboard_dir."""
    if kind == "wandb":
        return WandbSink(run, options["wandb_project"], Path(options["wandb_dir"]), options["wandb_mode"])
    if kind == "mlflow":
        return MlflowSink(run, options["mlflow_experiment"], options["mlflow_uri"])
    if kind == "tensorboard":
        return TensorboardSink(Path(options["tensorboard_dir"]))
    raise ConfigError(f"--to: unknown tracker {kind!r} (choose from {', '.join(SINKS)})")
