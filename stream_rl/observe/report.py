"""A run's summary, from its timeline (`runs/<run>/timeline.jsonl`); the plots are `stream_rl/observe/plots.py`.
The timeline holds one invocation of `stream-rl run` (the latest `start` and what followed), so
the summary describes what that invocation trained, and nothing before it.

stream-rl report --run R     re-derive summary.json and plots/ of a finished run
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from stream_rl.config import RunConfig
from stream_rl.observe.plots import evals_of, versions_of, write_plots


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def reward_curve(timeline: list[dict[str, Any]]) -> list[tuple[float, int, float]]:
    """(seconds since start, version, mean reward of the samples trained into that version)."""
    return [
        (r["t"], r["version"], r["reward_mean"])
        for r in versions_of(timeline)
        if r["version"] > 0 and "reward_mean" in r
    ]


def _eval_row(e: dict[str, Any]) -> dict[str, Any]:
    keys = ("version", "split", "pass_at_1", "sampled_pass_at_1", "pass_at_k", "k", "mean_length")
    return {k: e.get(k) for k in keys} | {"off_version_token_frac": e.get("off_version_token_frac")}


def summarize(
    timeline: list[dict[str, Any]], config: RunConfig, wall_s: float, exit_reason: str, failed: str | None
) -> dict[str, Any]:
    versions = versions_of(timeline)
    updates = [v for v in versions if v["version"] > 0]
    start = next((r for r in timeline if r.get("kind") == "start"), {})
    evals = evals_of(timeline)
    curve = reward_curve(timeline)
    rewards = [c[2] for c in curve]
    offsets = [r for r in timeline if r.get("kind") == "offsets"]
    throughput: dict[str, float] = {}
    if len(offsets) >= 2:
        first, last = offsets[0], offsets[-1]
        dt = max(last["t"] - first["t"], 1.0)  # a floor: records at one instant are no rate
        for stage, end in last["offsets"].items():
            throughput[f"{stage}_records_per_s"] = (end - first["offsets"].get(stage, 0)) / dt
    if len(updates) >= 2:
        dt = max(updates[-1]["t"] - updates[0]["t"], 1.0)
        throughput["trainer_samples_per_s"] = (
            updates[-1]["samples_trained"] - updates[0]["samples_trained"]
        ) / dt
        throughput["trainer_tokens_per_s"] = (
            updates[-1]["tokens_trained"] - updates[0]["tokens_trained"]
        ) / dt
    lags = [r["lag"] for r in timeline if r.get("kind") == "lag"]
    broker_lag = (
        {
            role: {
                "mean": statistics.fmean(lag.get(role, 0) for lag in lags),
                "max": max(lag.get(role, 0) for lag in lags),
            }
            for role in sorted({k for lag in lags for k in lag})
        }
        if lags
        else {}
    )
    bcast = [v["broadcast_ms"] for v in versions if v.get("broadcast_ms")]

    def metric(name: str) -> list[float]:
        return [float(v[name]) for v in updates if name in v]

    return {
        "run": config.run,
        "mode": config.mode,
        "exit_reason": exit_reason,
        "failed": failed,
        "wall_s": round(wall_s, 1),
        "resumed_from": start.get("resumed_from"),
        "software": start.get("software", {}),
        "versions": {
            "count": len(versions),
            "first": versions[0]["version"] if versions else None,
            "last": versions[-1]["version"] if versions else None,
            "max_steps": config.trainer.max_steps,
            "first_update_s": updates[0]["t"] if updates else None,
        },
        "reward": {
            "first3_mean": _mean(rewards[:3]),
            "last3_mean": _mean(rewards[-3:]),
            "max": max(rewards) if rewards else None,
            "curve": [{"t": t, "version": v, "reward": r} for t, v, r in curve],
        },
        "version_lag": {
            "mean": _mean(metric("version_lag_mean")),
            "max": max(metric("version_lag_max"), default=None),
            "samples_over_bound": int(sum(metric("samples_over_lag_bound"))),
        },
        "importance": {
            "ess_mean": _mean(metric("ess")),
            "ess_min": min(metric("ess"), default=None),
            "clamp_frac_mean": _mean(metric("clamp_frac")),
        },
        "broker_lag": broker_lag,
        "throughput": throughput,
        "weight_sync": {
            "broadcast_ms_mean": _mean(bcast),
            "broadcast_ms_p50": statistics.median(bcast) if bcast else None,
            "broadcast_ms_max": max(bcast, default=None),
            "updates_with_failed_servers": sum(1 for v in versions if v.get("servers_failed")),
            "servers_restarted": int(sum(metric("servers_restarted"))),
        },
        "samples_trained": updates[-1]["samples_trained"] if updates else 0,
        "faults": {
            "skipped_steps": int(sum(metric("skipped_step"))),
            "nonfinite_micro_batches": int(sum(metric("nonfinite_micro_batches"))),
            "duplicate_samples_dropped_by_trainer": int(sum(metric("duplicates"))),
        },
        "eval": {
            "records": len(evals),
            "first": _eval_row(evals[0]) if evals else None,
            "last": _eval_row(evals[-1]) if evals else None,
            "best_pass_at_1": max(
                (e["pass_at_1"] for e in evals if e.get("pass_at_1") is not None), default=None
            ),
            "curve": [_eval_row(e) for e in evals],
        },
    }


def load_timeline(path: Path) -> list[dict[str, Any]]:
    """The records of the latest run in a timeline file (a relaunch appends a new `start`)."""
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    starts = [i for i, r in enumerate(records) if r.get("kind") == "start"]
    return records[starts[-1] :] if starts else records


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", required=True, help="run name")
    p.add_argument("--runs-dir", default="runs")


def main(args: argparse.Namespace) -> int:
    from stream_rl.config import load_config
    from stream_rl.errors import StreamRLError

    run_dir = Path(args.runs_dir) / args.run
    timeline = load_timeline(run_dir / "timeline.jsonl")
    if not timeline:
        raise StreamRLError(f"no timeline in {run_dir}: was the run launched with `stream-rl run`?")
    config = load_config(run_dir / "config.yaml")
    old = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    summary = summarize(
        timeline,
        config,
        wall_s=old.get("wall_s", timeline[-1]["t"]),
        exit_reason=old.get("exit_reason", "unknown"),
        failed=old.get("failed"),
    )
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    paths = write_plots(timeline, run_dir / "plots")
    print(f"wrote {run_dir / 'summary.json'} and {len(paths)} plots in {run_dir / 'plots'}")
    return 0
