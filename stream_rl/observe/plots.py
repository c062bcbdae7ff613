"""The run plots, from its timeline (`runs/<run>/timeline.jsonl`): what is drawn is computed first
(`panels()`: pure data, tested against physical bounds), then drawn (`write_plots()`).

Rates are never the quotient of two neighbouring samples: two records can share a timestamp (two
versions read by one tick of the launcher), and dividing by ~0 s draws spikes of 1e11 records/s.
Every rate is `windowed_rates`: the counter's increase over a trailing window of `RATE_WINDOW_S`,
divided by the window's actual duration, which is at least `RATE_MIN_S` (points before the first
full-enough window are left out).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RATE_WINDOW_S = 10.0
RATE_MIN_S = 4.0


@dataclass
class Line:
    label: str
    xs: list[float]
    ys: list[float]
    style: str = "-"
    alpha: float = 1.0


@dataclass
class Panel:
    title: str
    xlabel: str
    ylabel: str
    lines: list[Line] = field(default_factory=list)
    yscale: str = "linear"
    ylim: tuple[float, float] | None = None
    legend_loc: str = "best"
    legend_cols: int = 1
    yticks: list[float] | None = None


def windowed_rates(
    points: list[tuple[float, float]], window_s: float = RATE_WINDOW_S, min_s: float = RATE_MIN_S
) -> tuple[list[float], list[float]]:
    """(times, rates) of a cumulative counter sampled at `points` (time, value), in time order.

    At each point the rate is (value - value_then) / (t - t_then), where `then` is the latest
    earlier point at least `window_s` before it, or the first point; points whose span is shorter
    than `min_s` get no rate. Equal timestamps therefore never divide by zero."""
    pts = sorted(points, key=lambda p: p[0])
    ts: list[float] = []
    rates: list[float] = []
    j = 0
    for t, value in pts:
        while j + 1 < len(pts) and t - pts[j + 1][0] >= window_s:
            j += 1
        t0, v0 = pts[j]
        if t - t0 >= min_s:
            ts.append(t)
            rates.append((value - v0) / (t - t0))
    return ts, rates


def versions_of(timeline: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Version records, one per version (a re-published version keeps its first record)."""
    seen: dict[int, dict[str, Any]] = {}
    for r in timeline:
        if r.get("kind") == "version" and r["version"] not in seen:
            seen[r["version"]] = r
    return [seen[v] for v in sorted(seen)]


def evals_of(timeline: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Eval records, one per (version, split), in version order (the first record wins)."""
    seen: dict[tuple[int, str], dict[str, Any]] = {}
    for r in timeline:
        if r.get("kind") == "eval":
            seen.setdefault((r["version"], r.get("split", "")), r)
    return [seen[k] for k in sorted(seen)]


def panels(timeline: list[dict[str, Any]]) -> dict[str, Panel]:
    """Every plot's data: reward, eval, version_lag, broker_lag, throughput."""
    updates = [v for v in versions_of(timeline) if v["version"] > 0]
    lag_records = [r for r in timeline if r.get("kind") == "lag"]
    offsets = [r for r in timeline if r.get("kind") == "offsets"]
    out: dict[str, Panel] = {}

    reward = Panel("reward of trained samples", "wall time (s)", "mean reward")
    pts = [(float(v["t"]), float(v["reward_mean"])) for v in updates if "reward_mean" in v]
    if pts:
        ts, rs = [p[0] for p in pts], [p[1] for p in pts]
        k = max(1, len(rs) // 20)
        ma = [statistics.fmean(rs[max(0, i - k + 1) : i + 1]) for i in range(len(rs))]
        reward.lines = [Line("per version", ts, rs, ".", 0.4), Line(f"moving mean ({k})", ts, ma)]
    out["reward"] = reward

    # Pass rates fill [0, 1]: the legend gets its own band above 1.
    ev = Panel(
        "held-out evaluation", "version", "pass rate", ylim=(-0.02, 1.38), legend_loc="upper center",
        legend_cols=2, yticks=[0.0, 0.2, 0.4, 0.6, 0.8, 1.0],
    )  # fmt: skip
    evals = evals_of(timeline)
    for split in sorted({e.get("split", "") for e in evals}):
        rows = [e for e in evals if e.get("split", "") == split]
        for key, label in (("pass_at_1", "greedy pass@1"), ("sampled_pass_at_1", "sampled pass@1")):
            xy = [(float(e["version"]), float(e[key])) for e in rows if e.get(key) is not None]
            if xy:
                ev.lines.append(Line(f"{split}: {label}", [p[0] for p in xy], [p[1] for p in xy], "o-"))
        xy = [(float(e["version"]), float(e["pass_at_k"])) for e in rows if e.get("pass_at_k") is not None]
        if xy:
            ev.lines.append(
                Line(f"{split}: pass@{rows[-1].get('k')}", [p[0] for p in xy], [p[1] for p in xy], "s--")
            )
    train = [(float(v["version"]), float(v["reward_mean"])) for v in updates if "reward_mean" in v]
    if ev.lines and train and all(0.0 <= r <= 1.0 for _, r in train):
        ev.lines.append(Line("train reward", [p[0] for p in train], [p[1] for p in train], "-", 0.3))
    out["eval"] = ev

    lag = Panel("version lag of trained samples", "version", "versions behind")
    rows = [v for v in updates if "version_lag_mean" in v]
    if rows:
        vs = [float(v["version"]) for v in rows]
        lag.lines = [
            Line("mean", vs, [float(v["version_lag_mean"]) for v in rows]),
            Line("max", vs, [float(v.get("version_lag_max", 0)) for v in rows]),
        ]
    out["version_lag"] = lag

    # The actor's lag on `problems` is the loader's whole backlog (paced by admission), orders of
    # magnitude above the others: a symmetric log scale keeps every group readable.
    broker = Panel("broker lag per consumer group", "wall time (s)", "records (symlog)", yscale="symlog")
    for role in sorted({k for r in lag_records for k in r["lag"]}):
        broker.lines.append(
            Line(
                role,
                [float(r["t"]) for r in lag_records],
                [float(r["lag"].get(role, 0)) for r in lag_records],
            )
        )
    out["broker_lag"] = broker

    thr = Panel(f"throughput per stage ({RATE_WINDOW_S:.0f} s window)", "wall time (s)", "records/s")
    # The loader writes its whole backlog at once: its burst would flatten the other curves.
    for stage in sorted({k for r in offsets for k in r["offsets"]} - {"loader"}):
        ts, rates = windowed_rates([(float(r["t"]), float(r["offsets"].get(stage, 0))) for r in offsets])
        thr.lines.append(Line(f"{stage} out", ts, rates))
    ts, rates = windowed_rates([(float(v["t"]), float(v["samples_trained"])) for v in updates])
    if ts:
        thr.lines.append(Line("trainer samples", ts, rates, "-", 0.7))
    out["throughput"] = thr
    scaled = autoscale_panel(timeline)
    if scaled is not None:
        out["autoscale"] = scaled
    return out


def autoscale_panel(timeline: list[dict[str, Any]]) -> Panel | None:
    """Replicas per stage over time (`launcher.autoscale`'s `replicas` records), and a marker per
    decision labelled with the signal that moved it; None for a run that does not autoscale."""
    samples = [r for r in timeline if r.get("kind") == "replicas"]
    if not samples:
        return None
    panel = Panel("autoscale: replicas per stage", "wall time (s)", "replicas", legend_loc="upper left")
    decisions = [r for r in timeline if r.get("kind") == "autoscale" and not r.get("error")]
    roles = sorted({k for r in samples for k in r["replicas"]})
    for role in roles:
        if (
            not any(d["role"] == role for d in decisions)
            and len({r["replicas"].get(role) for r in samples}) < 2
        ):
            continue  # not resized: no line
        panel.lines.append(
            Line(
                role,
                [float(r["t"]) for r in samples],
                [float(r["replicas"].get(role, 0)) for r in samples],
                "-",
            )
        )
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for d in decisions:
        up = 1 if d["after"] > d["before"] else -1
        groups.setdefault((d["role"], up, d["signal"]), []).append(d)
    for (role, up, signal), ds in sorted(groups.items()):
        panel.lines.append(
            Line(
                f"{role} {'+1' if up > 0 else '-1'}: {signal}",
                [float(d["t"]) for d in ds],
                [float(d["after"]) for d in ds],
                "^" if up > 0 else "v",
            )
        )
    return panel


def _draw(ax: Any, panel: Panel) -> None:
    for line in panel.lines:
        ax.plot(line.xs, line.ys, line.style, label=line.label, alpha=line.alpha)
    if panel.lines:
        ax.legend(fontsize="small", loc=panel.legend_loc, ncol=panel.legend_cols, framealpha=0.7)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
    if panel.xlabel == "version":  # versions are integers: no 1.5 ticks
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if panel.yscale == "symlog":
        ax.set_yscale("symlog", linthresh=10)
    if panel.ylim is not None:
        ax.set_ylim(*panel.ylim)
    if panel.yticks is not None:
        ax.set_yticks(panel.yticks)
    ax.set(title=panel.title, xlabel=panel.xlabel, ylabel=panel.ylabel)


def write_plots(timeline: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """One PNG per panel (`reward.png`, `eval.png`, ...) and `overview.png` with all of them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    data = panels(timeline)
    written = []
    for name, panel in data.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        _draw(ax, panel)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    fig, axes = plt.subplots(2, 3, figsize=(17, 8))
    for ax, panel in zip(axes.flat, data.values(), strict=False):
        _draw(ax, panel)
    for ax in list(axes.flat)[len(data) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out_dir / "overview.png", dpi=100)
    plt.close(fig)
    written.append(out_dir / "overview.png")
    return written
