"""The figures of `bench/pipeline_vs_conventional.py`: reward against wall time and samples, and
batch occupancy with each mode's version-lag distribution (one colour per mode)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from run_probe import centered_mean, fmt

COLOURS = {
    "conventional": "tab:red",
    "pipeline": "tab:blue",
    "pipeline-recompute": "tab:purple",
    "pipeline-no-inflight": "tab:green",
    "pipeline-guard": "tab:orange",
}


def plot(runs: list[dict[str, Any]], target: float, window: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_samples) = plt.subplots(1, 2, figsize=(13, 4.8))
    styles = ["-", "--", ":", "-."]
    for r in runs:
        if "error" in r or not r["curve"]:
            continue
        ts = [c["t"] for c in r["curve"]]
        ns = [c["samples"] for c in r["curve"]]
        rs = [c["reward"] for c in r["curve"]]
        smooth = centered_mean(rs, window)
        colour, style = COLOURS[r["mode"]], styles[(r["repeat"] - 1) % len(styles)]
        label = f"{r['mode']} (run {r['repeat']})"
        by_time.plot(ts, rs, ".", color=colour, alpha=0.15)
        by_time.plot(ts, smooth, style, color=colour, label=label)
        by_samples.plot(ns, smooth, style, color=colour, label=label)
        if r["time_to_target_s"] is not None:
            by_time.plot([r["time_to_target_s"]], [target], "o", color=colour)
    for ax in (by_time, by_samples):
        ax.axhline(target, color="grey", lw=0.8, ls="--")
        ax.set_ylabel(f"reward of trained samples (centred mean of {window} versions)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    by_time.set(xlabel="wall time since version 0 (s)", title="reward against wall time")
    by_samples.set(xlabel="samples trained", title="reward against samples")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_occupancy(runs: list[dict[str, Any]], path: Path) -> None:
    """Batch occupancy against time for the first run of each mode, and each mode's per-sample
    version-lag distribution (all its runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (occ, lags) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [2, 1]})
    shown: set[str] = set()
    counts: dict[str, dict[int, int]] = {}
    for r in runs:
        if "error" in r:
            continue
        for lag, n in r.get("lag_counts", {}).items():
            counts.setdefault(r["mode"], {})[int(lag)] = counts.get(r["mode"], {}).get(int(lag), 0) + n
        if r["mode"] in shown or not r.get("occupancy_series"):
            continue
        shown.add(r["mode"])
        ts = [p["t"] for p in r["occupancy_series"]]
        ys = [p["occupancy"] for p in r["occupancy_series"]]
        label = f"{r['mode']} (run {r['repeat']}, mean {fmt(r.get('occupancy'))})"
        occ.plot(ts, ys, "-", color=COLOURS[r["mode"]], lw=1.0, label=label)
    occ.set(
        xlabel="wall time since version 0 (s)",
        ylabel="running sequences / max batch (1 s means)",
        title="engine batch occupancy",
        ylim=(0, 1.05),
    )
    occ.legend(fontsize=8, loc="lower right")
    occ.grid(alpha=0.3)
    width = 0.8 / max(len(counts), 1)
    for i, (mode, by_lag) in enumerate(counts.items()):
        total = sum(by_lag.values()) or 1
        xs = sorted(by_lag)
        lags.bar(  # the modes side by side, centred on their integer lag
            [x + (i - (len(counts) - 1) / 2) * width for x in xs],
            [by_lag[x] / total for x in xs],
            width,
            color=COLOURS[mode],
            label=mode,
        )
    lags.set(
        xlabel="version lag of a trained sample (oldest span)",
        ylabel="share of samples",
        title="lag distribution",
    )
    lags.set_xticks(sorted({lag for by_lag in counts.values() for lag in by_lag}))
    lags.legend(fontsize=8)
    lags.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
