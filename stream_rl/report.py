"""A run's summary and plots, from its timeline (`runs/<run>/timeline.jsonl`).

stream-rl report --run R     re-derive summary.json and plots/ of a finished run
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from stream_rl.config import RunConfig


def _versions(timeline: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Version records, one per version (a re-published version keeps its first record)."""
    seen: dict[int, dict[str, Any]] = {}
    for r in timeline:
        if r.get("kind") == "version" and r["version"] not in seen:
            seen[r["version"]] = r
    return [seen[v] for v in sorted(seen)]


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def reward_curve(timeline: list[dict[str, Any]]) -> list[tuple[float, int, float]]:
    """(seconds since start, version, mean reward of the samples trained into that version)."""
    return [
        (r["t"], r["version"], r["reward_mean"])
        for r in _versions(timeline)
        if r["version"] > 0 and "reward_mean" in r
    ]


def summarize(
    timeline: list[dict[str, Any]], config: RunConfig, wall_s: float, exit_reason: str, failed: str | None
) -> dict[str, Any]:
    versions = _versions(timeline)
    updates = [v for v in versions if v["version"] > 0]
    curve = reward_curve(timeline)
    rewards = [c[2] for c in curve]
    offsets = [r for r in timeline if r.get("kind") == "offsets"]
    throughput: dict[str, float] = {}
    if len(offsets) >= 2:
        first, last = offsets[0], offsets[-1]
        dt = max(last["t"] - first["t"], 1e-9)
        for stage, end in last["offsets"].items():
            throughput[f"{stage}_records_per_s"] = (end - first["offsets"].get(stage, 0)) / dt
    if len(updates) >= 2:
        dt = max(updates[-1]["t"] - updates[0]["t"], 1e-9)
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
        "versions": {
            "count": len(versions),
            "last": versions[-1]["version"] if versions else None,
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
        },
        "samples_trained": updates[-1]["samples_trained"] if updates else 0,
        "faults": {
            "skipped_steps": int(sum(metric("skipped_step"))),
            "nonfinite_micro_batches": int(sum(metric("nonfinite_micro_batches"))),
            "duplicate_samples_dropped_by_trainer": int(sum(metric("duplicates"))),
        },
    }


def write_plots(timeline: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """reward.png, version_lag.png, broker_lag.png, throughput.png (and overview.png: all four)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    updates = [v for v in _versions(timeline) if v["version"] > 0]
    lag_records = [r for r in timeline if r.get("kind") == "lag"]
    offsets = [r for r in timeline if r.get("kind") == "offsets"]

    def reward(ax: Any) -> None:
        pts = [(v["t"], v["reward_mean"]) for v in updates if "reward_mean" in v]
        if pts:
            ts, rs = zip(*pts, strict=True)
            ax.plot(ts, rs, ".", alpha=0.4, label="per version")
            k = max(1, len(rs) // 20)
            ma = [statistics.fmean(rs[max(0, i - k + 1) : i + 1]) for i in range(len(rs))]
            ax.plot(ts, ma, "-", label=f"moving mean ({k})")
            ax.legend()
        ax.set(title="reward of trained samples", xlabel="wall time (s)", ylabel="mean reward")

    def version_lag(ax: Any) -> None:
        vs = [v["version"] for v in updates if "version_lag_mean" in v]
        if vs:
            ax.plot(vs, [v["version_lag_mean"] for v in updates if "version_lag_mean" in v], label="mean")
            ax.plot(
                vs, [v.get("version_lag_max", 0) for v in updates if "version_lag_mean" in v], label="max"
            )
            ax.legend()
        ax.set(title="version lag of trained samples", xlabel="version", ylabel="versions behind")

    def broker_lag(ax: Any) -> None:
        roles = sorted({k for r in lag_records for k in r["lag"]})
        for role in roles:
            ax.plot([r["t"] for r in lag_records], [r["lag"].get(role, 0) for r in lag_records], label=role)
        if roles:
            ax.legend()
        # The actor's lag on `problems` is the loader's whole backlog (paced by admission), orders
        # of magnitude above the others: a symmetric log scale keeps every group readable.
        ax.set_yscale("symlog", linthresh=10)
        ax.set(title="broker lag per consumer group", xlabel="wall time (s)", ylabel="records (symlog)")

    def throughput(ax: Any) -> None:
        # The loader writes its whole backlog at once: its burst would flatten the other curves.
        stages = sorted({k for r in offsets for k in r["offsets"]} - {"loader"})
        for stage in stages:
            ts, rates = [], []
            for a, b in zip(offsets, offsets[1:], strict=False):
                dt = b["t"] - a["t"]
                if dt > 0:
                    ts.append(b["t"])
                    rates.append((b["offsets"].get(stage, 0) - a["offsets"].get(stage, 0)) / dt)
            ax.plot(ts, rates, label=f"{stage} out")
        pts = [(v["t"], v["samples_trained"]) for v in updates]
        if len(pts) >= 2:
            ax.plot(
                [b[0] for b in pts[1:]],
                [(b[1] - a[1]) / max(b[0] - a[0], 1e-9) for a, b in zip(pts, pts[1:], strict=False)],
                label="trainer samples",
                alpha=0.6,
            )
        if stages:
            ax.legend()
        ax.set(title="throughput per stage", xlabel="wall time (s)", ylabel="records/s")

    panels = {
        "reward": reward,
        "version_lag": version_lag,
        "broker_lag": broker_lag,
        "throughput": throughput,
    }
    written = []
    for name, draw in panels.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        draw(ax)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, draw in zip(axes.flat, panels.values(), strict=True):
        draw(ax)
    fig.tight_layout()
    fig.savefig(out_dir / "overview.png", dpi=100)
    plt.close(fig)
    written.append(out_dir / "overview.png")
    return written


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", required=True, help="run name")
    p.add_argument("--runs-dir", default="runs")


def main(args: argparse.Namespace) -> int:
    from stream_rl.config import load_config
    from stream_rl.errors import StreamRLError
    from stream_rl.monitor import load_timeline

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
