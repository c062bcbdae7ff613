"""bench/nemesis.py's plot of a results JSON (split from it by role)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLORS = {
    "pause": "tab:orange",
    "partition": "tab:red",
    "slow-link": "tab:purple",
    "disk-full": "tab:brown",
    "cpu-limit": "tab:olive",
    "server-500": "tab:cyan",
    "server-hang": "tab:blue",
}


def plot(result: dict[str, Any], path: Path, max_lag: int) -> None:
    """Weight versions, the trained samples' lag and every process's memory against time, each
    fault's span shaded by kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = result["t0"]
    fig, (ax_v, ax_l, ax_m) = plt.subplots(3, 1, figsize=(13, 11), sharex=True)
    seen = result["version_times"]
    ax_v.step([(t - t0) / 60 for _v, t in seen], [v for v, _t in seen], where="post", color="k")
    ax_v.set_ylabel("weight version")
    lag = result["lag_by_version"]
    at = dict((v, t) for v, t in seen)
    pts = [((at[v] - t0) / 60, lag[str(v)]) for v in map(int, lag) if v in at]
    ax_l.plot([p[0] for p in pts], [p[1] for p in pts], ".", ms=3, color="tab:green")
    ax_l.axhline(max_lag + 1, color="r", ls="--", lw=0.8, label=f"max_lag + 1 = {max_lag + 1}")
    ax_l.set_ylabel("max lag of the samples\ntrained by the version")
    ax_l.legend(loc="upper right")
    for name, pts2 in sorted(result["memory"].items()):
        fitted = result["slopes"][name]
        # The pid the slope is of (the longest-lived), without readings of 0 (a zombie); a process
        # with no slope (the loader, which ends early) is left out.
        mine = [(t, r) for t, r, p in pts2 if p == fitted["pid"] and r > 0]
        if not fitted["minutes"] or not mine:
            continue
        first = mine[0][1]
        restarts = f", {fitted['restarts']} restart(s)" if fitted["restarts"] else ""
        # The ceiling's slope (a leak lifts it; dips and a saw do not), where the results have it.
        ceiling = f", ceiling {fitted['ceiling_slope']:+.3f}" if "ceiling_slope" in fitted else ""
        ax_m.plot(
            [(t - t0) / 60 for t, _r in mine], [r - first for _t, r in mine],
            label=f"{name} ({first:.0f} MiB, {fitted['slope_mib_per_min']:+.3f}{ceiling} MiB/min{restarts})",
        )  # fmt: skip
    ax_m.set_ylabel("RSS growth since its\nfirst sample (MiB)")
    ax_m.set_xlabel(
        f"minutes (each process's longest-lived pid; slopes fitted, and of each 5-min window's greatest, "
        f"after {result.get('warmup_s', 300) / 60:.0f} min of warm-up)"
    )
    ax_m.legend(
        fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.22)
    )  # below: the lines fill the panel
    starts = {}
    labelled = set()
    for e in result["events"]:
        if e["phase"] == "start":
            starts[e["fault"]] = e["t"]
        elif e["phase"] == "end" and e["fault"] in starts:
            kind = e["kind"]
            for ax in (ax_v, ax_l, ax_m):
                ax.axvspan(
                    (starts[e["fault"]] - t0) / 60, (e["t"] - t0) / 60, color=COLORS.get(kind, "grey"), alpha=0.25,
                    label=None if ax is not ax_v or kind in labelled else kind,
                )  # fmt: skip
            labelled.add(kind)
    ax_v.legend(loc="upper left", fontsize=8, ncol=4)
    c = result["counts"]
    fig.suptitle(
        f"{result['minutes']} min under the nemesis (seed {result['seed']}), 3-node cluster: "
        f"{c['trained']} trained, {c['trained_twice']} twice, {c['lost']} lost, gapless {c['gapless']}, "
        f"{c['beyond_lag_bound']} beyond max_lag + 1"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
