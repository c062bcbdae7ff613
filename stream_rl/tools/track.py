"""`stream-rl track --run R --to mlflow|wandb|tensorboard [--follow]`: a run's record in a tracker.

The topics are the record: per weight version, the trainer's step metrics (`train/loss`,
`train/reward_mean`, `train/version_lag_mean`, `train/samples_per_s`, `train/tokens_per_s`, ... and
the lineage counters `train/samples_trained`, `train/tokens_trained`, `train/broadcast_ms`) from
`weight-versions`; the held-out evaluations (`eval/<split>/pass_at_1`, `.../pass_at_<k>`,
`.../sampled_pass_at_1`, `.../mean_length`, `.../off_version_token_frac`, `.../verdict/<v>`)
from `eval-results`; broker lag per consumer group (`lag/<group>`: the launcher's timeline when
backfilling, the live lag when following); and the resolved config as parameters. Everything is
logged at step = version.

Without `--follow` it backfills what the topics hold (a finished run, or one still going, up to
now) and exits; with `--follow` it logs each version as it is published until the final version
(and its evaluation, when the run evaluates) -- the launcher runs it so for `track.to`.
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

import yaml

from stream_rl.config import RunConfig, dump_config
from stream_rl.contracts import EvalResult, WeightVersion, WeightVersionKind
from stream_rl.kafka.reader import read_to_end
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.stage import StopFlag
from stream_rl.kafka.topics import EVAL_RESULTS, TopicNames
from stream_rl.kafka.transport import Transport
from stream_rl.tools.trackers import SINKS, Sink, open_sink

log = logging.getLogger(__name__)


def flat_params(config: RunConfig) -> dict[str, Any]:
    """The resolved config as `section.key: value` (secrets left out)."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = node

    walk(yaml.safe_load(dump_config(config)), "")
    return out


def version_metrics(wv: WeightVersion) -> dict[str, float]:
    out = {f"train/{k}": float(v) for k, v in wv.metrics.items()}
    out.update(
        {
            "train/samples_trained": float(wv.samples_trained),
            "train/tokens_trained": float(wv.tokens_trained),
            "train/samples_filtered": float(wv.samples_filtered),
            "train/broadcast_ms": float(wv.broadcast_ms),
            "train/servers_failed": float(len(wv.servers_failed)),
        }
    )
    return out


def eval_metrics(ev: EvalResult) -> dict[str, float]:
    p = f"eval/{ev.split}/"
    out = {
        p + "mean_length": ev.mean_length,
        p + "mean_reward": ev.mean_reward,
        p + "off_version_token_frac": ev.off_version_token_frac,
    }
    if ev.pass_at_1 is not None:
        out[p + "pass_at_1"] = ev.pass_at_1
    if ev.sampled_pass_at_1 is not None:
        out[p + "sampled_pass_at_1"] = ev.sampled_pass_at_1
    if ev.pass_at_k is not None:
        out[p + f"pass_at_{ev.k}"] = ev.pass_at_k
    total = sum(ev.verdicts.values()) or 1
    out.update({p + f"verdict/{k}": v / total for k, v in ev.verdicts.items()})
    return out


def lag_by_version(timeline: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """The last broker-lag sample of the launcher's timeline taken while each version was current."""
    out: dict[int, dict[str, float]] = {}
    current: int | None = None
    for r in timeline:
        if r.get("kind") == "version":
            current = max(current if current is not None else -1, int(r["version"]))
        elif r.get("kind") == "lag" and current is not None:
            out[current] = {f"lag/{role}": float(v) for role, v in r["lag"].items()}
    return out


def read_all(transport: Transport, topic: str, cls: Any) -> list[Any]:
    from stream_rl.errors import KafkaError

    try:
        transport.watermarks(topic)
    except KafkaError:
        return []  # no such topic (a run from before it existed)
    serde = default_serde()
    return [serde.decode(m.value, cls) for m in read_to_end(transport, topic, client_id="track")]


def backfill_steps(
    versions: list[WeightVersion], evals: list[EvalResult], lags: dict[int, dict[str, float]]
) -> list[tuple[int, dict[str, float], int]]:
    """(version, metrics, wall ms) per version, in version order (first record of each version)."""
    by_v: dict[int, tuple[dict[str, float], int]] = {}
    for wv in versions:
        if wv.version not in by_v:
            by_v[wv.version] = ({**version_metrics(wv), **lags.get(wv.version, {})}, wv.created_ms)
    for ev in evals:
        metrics, wall = by_v.setdefault(ev.version, ({}, ev.finished_ms))
        metrics.update(eval_metrics(ev))
    return [(v, *by_v[v]) for v in sorted(by_v)]


def sink_options(config: RunConfig, overrides: dict[str, Any]) -> dict[str, Any]:
    t = config.track
    options = {
        "wandb_project": t.wandb_project,
        "wandb_mode": t.wandb_mode,
        "wandb_dir": t.wandb_dir or str(config.run_dir),
        "mlflow_uri": t.mlflow_uri,
        "mlflow_experiment": t.mlflow_experiment,
        "tensorboard_dir": t.tensorboard_dir or str(config.run_dir / "tensorboard"),
    }
    options.update({k: v for k, v in overrides.items() if v is not None})
    return options


def backfill(config: RunConfig, transport: Transport, sinks: list[Sink]) -> int:
    """Log everything the run's topics hold into `sinks`; returns the versions logged."""
    from stream_rl.observe.report import load_timeline
    from stream_rl.train.lineage import read_weight_versions

    names = TopicNames(run=config.run, prefix=config.kafka.prefix)
    versions = read_weight_versions(transport, names)
    evals = read_all(transport, names[EVAL_RESULTS], EvalResult)
    lags = lag_by_version(load_timeline(config.run_dir / "timeline.jsonl"))
    steps = backfill_steps(versions, evals, lags)
    params = flat_params(config)
    for sink in sinks:
        sink.params(params)
        for version, metrics, wall in steps:
            sink.log(version, metrics, wall)
    return len(steps)


def follow(config: RunConfig, transport: Transport, sinks: list[Sink], stop: StopFlag) -> int:
    """Log each version (and evaluation) as it is published, until the final one; returns the
    versions logged."""
    from stream_rl.kafka.follower import RecordFollower, VersionFollower
    from stream_rl.kafka.lag import run_lags

    names = TopicNames(run=config.run, prefix=config.kafka.prefix)
    versions = VersionFollower(transport, names, client_id="track-versions", keep_history=True).start()
    evals = RecordFollower(
        transport, names[EVAL_RESULTS], EvalResult, "track-evals", keep_history=True
    ).start()
    params = flat_params(config)
    for sink in sinks:
        sink.params(params)
    # The newest version logged (a version published again, after a trainer restart, is skipped)
    # and how many were logged: a run of any length costs the tracker the same memory.
    last_v = -1
    logged = 0
    final_at: float | None = None

    def log_new() -> None:
        nonlocal last_v, logged, final_at
        for wv in versions.drain():
            if wv.version <= last_v:
                continue
            last_v = wv.version
            logged += 1
            metrics = version_metrics(wv)
            lag: dict[str, float] = {}
            for x in run_lags(transport, names, with_age=False):
                key = f"lag/{x.group.rsplit('.', 1)[-1]}"
                lag[key] = lag.get(key, 0.0) + x.lag
            for sink in sinks:
                sink.log(wv.version, {**metrics, **lag}, wv.created_ms)
            if wv.kind == WeightVersionKind.FINAL:
                final_at = time.monotonic()
        for ev in evals.drain():
            for sink in sinks:
                sink.log(ev.version, eval_metrics(ev), ev.finished_ms)

    try:
        while not stop:
            log_new()
            if final_at is not None:
                evaluated = not config.eval.every or any(ev.version == last_v for ev in evals.records)
                if evaluated or time.monotonic() - final_at > config.eval.timeout_s:
                    break
            time.sleep(0.5)
        # What the followers read since the last drain: the final version's evaluation can land in
        # `evals.records` after that drain (the check above then ends the loop), and a SIGTERM
        # (the launcher stopping the run) must not drop what was already read.
        log_new()
    finally:
        versions.stop()
        evals.stop()
    return logged


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from stream_rl.cli import add_common

    parser.add_argument("--run", required=True, help="run name")
    parser.add_argument("--runs-dir", default="runs", help="where runs live (default runs/)")
    parser.add_argument(
        "--to", action="append", choices=SINKS, default=None, help="tracker (repeatable; default: track.to)"
    )
    parser.add_argument(
        "--follow", action="store_true", help="log versions as they come, until the final one"
    )
    parser.add_argument("--mlflow-uri", default=None, help="MLflow tracking URI (default track.mlflow_uri)")
    parser.add_argument(
        "--experiment", default=None, help="MLflow experiment (default track.mlflow_experiment)"
    )
    parser.add_argument("--wandb-project", default=None)
    parser.add_argument("--wandb-mode", choices=("online", "offline"), default=None)
    parser.add_argument("--wandb-dir", default=None)
    parser.add_argument("--tensorboard-dir", default=None)
    add_common(parser, config=False)


def main(args: argparse.Namespace) -> int:
    from stream_rl.errors import ConfigError
    from stream_rl.kafka.confluent import KafkaTransport
    from stream_rl.tools.export import run_config

    config = run_config(args.runs_dir, args.run)
    kinds = args.to or list(config.track.to)
    if not kinds:
        raise ConfigError("which tracker? pass --to mlflow|wandb|tensorboard (or set track.to)")
    options = sink_options(
        config,
        {
            "mlflow_uri": args.mlflow_uri,
            "mlflow_experiment": args.experiment,
            "wandb_project": args.wandb_project,
            "wandb_mode": args.wandb_mode,
            "wandb_dir": args.wandb_dir,
            "tensorboard_dir": args.tensorboard_dir,
        },
    )
    transport = KafkaTransport.for_run(config.kafka, args.bootstrap)
    sinks = [open_sink(kind, config.run, options) for kind in dict.fromkeys(kinds)]
    stop = StopFlag()
    stop.install_signal_handlers()
    try:
        count = follow(config, transport, sinks, stop) if args.follow else backfill(config, transport, sinks)
    finally:
        for sink in sinks:
            sink.close()
    where = {
        "wandb": f"W&B {options['wandb_mode']} in {options['wandb_dir']}",
        "mlflow": f"MLflow {options['mlflow_uri'] or '(default tracking URI)'}, experiment {options['mlflow_experiment']}",
        "tensorboard": f"TensorBoard {options['tensorboard_dir']}",
    }
    print(
        f"track: {count} versions of run {config.run} logged to "
        + "; ".join(where[k] for k in dict.fromkeys(kinds))
    )
    return 0
