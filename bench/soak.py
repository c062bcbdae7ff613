"""Soak: run a config through the launcher for a while, sample every process's memory and CPU.

    .venv/bin/python bench/soak.py [--config configs/demo-cpu.yaml] [--minutes 16] [--warmup 4]
        [--every 10] [--name soak] [--repo <other checkout>] [--env KEY=VALUE ...] [--trace]

It starts its own broker (so the broker's pid is known), launches the run with a large step
budget and `launcher.max_wall_s`, and every `--every` seconds reads, for the launcher, the broker
and each child of `processes.json` (restarted children included), the resident set (VmRSS, with
its descendants: the verifier's scoring workers; and RssAnon, the part no file backs) and the
user+system CPU time (from /proc).

Reported per process: RSS at the end of the warm-up and at the end, the least-squares RSS slope
after the warm-up with its standard error (MiB/min; issue 15's goal: <= 0.05 for every process),
the slope of the last half alone (a bounded window still filling shows as a first half steeper
than the second), the anonymous-RSS slope, the CPU seconds over the measured window and their
share of all processes' CPU (issue 12's broker goal: <= 0.05). Prints a table, writes
`bench/results/<name>.json` (the samples included) and `bench/results/<name>.png` (RSS against
time per process, warm-up shaded, the fitted line drawn).

`--trace` finds what grows instead of measuring it: every Python process runs under tracemalloc
(`bench/soak_trace/sitecustomize.py`, a snapshot every `--trace-every` seconds) and the report
lists, per process, the traced Python heap's slope and the allocation sites that grew most
between the first snapshot after the warm-up and the last. Tracing costs CPU and memory: a traced
run's RSS figures are not the soak's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from stream_rl.common.ports import free_port  # noqa: E402
from stream_rl.kafka.broker import LocalBroker  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
GOAL_MIB_PER_MIN = 0.05
TRACE_DIR = Path(__file__).resolve().parent / "soak_trace"


def _stat(pid: int) -> tuple[int, float, int] | None:
    """(ppid, cpu seconds, rss bytes) of a live process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw.rsplit(")", 1)[1].split()
    ppid, utime, stime, rss_pages = int(fields[1]), int(fields[11]), int(fields[12]), int(fields[21])
    return ppid, (utime + stime) / TICK, rss_pages * PAGE


def _rss_anon(pid: int) -> int:
    """RssAnon of a process in bytes (0 when gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _tree() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is not None:
                children.setdefault(st[0], []).append(int(entry.name))
    return children


def _measure(pid: int, tree: dict[int, list[int]], exclude: set[int]) -> tuple[float, int, int] | None:
    """CPU seconds, RSS and anonymous RSS of `pid` and its descendants (not those in `exclude`);
    None when gone."""
    if _stat(pid) is None:
        return None
    cpu, rss, anon, todo = 0.0, 0, 0, [pid]
    while todo:
        p = todo.pop()
        st = _stat(p)
        if st is None:
            continue
        cpu += st[1]
        rss += st[2]
        anon += _rss_anon(p)
        todo.extend(c for c in tree.get(p, []) if c not in exclude)
    return cpu, rss, anon


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares slope of (t, y) and its standard error (0, 0 for fewer than 3 points)."""
    n = len(points)
    if n < 3:
        return 0.0, 0.0
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    den = sum((t - mt) ** 2 for t, _ in points)
    if not den:
        return 0.0, 0.0
    b = sum((t - mt) * (y - my) for t, y in points) / den
    resid = sum((y - my - b * (t - mt)) ** 2 for t, y in points)
    return b, math.sqrt(resid / (n - 2) / den)


def summarize(
    samples: dict[str, list[list[float]]], warmup: float, end: float = math.inf
) -> list[dict[str, Any]]:
    """One row per process from its samples [(minutes, cpu_s, rss_mib, anon_mib)] between the
    warm-up and `end` (the run's wall limit: later samples are the stop, processes exiting)."""
    rows = []
    for name, pts in sorted(samples.items()):
        window = [p for p in pts if warmup <= p[0] <= end]
        rss = [(p[0], p[2]) for p in window]
        anon = [(p[0], p[3]) for p in window]
        half = [p for p in rss if p[0] >= (rss[0][0] + rss[-1][0]) / 2] if rss else []
        slope, err = fit(rss)
        rows.append(
            {
                "process": name,
                "rss_warm_mib": rss[0][1] if rss else None,
                "rss_end_mib": rss[-1][1] if rss else None,
                "rss_slope_mib_per_min": slope,
                "rss_slope_stderr": err,
                "rss_slope_last_half": fit(half)[0],
                "anon_slope_mib_per_min": fit(anon)[0],
                "cpu_s": max(window[-1][1] - window[0][1], 0.0) if len(window) > 1 else 0.0,
                "measured_min": rss[-1][0] - rss[0][0] if rss else 0.0,
                "meets_goal": (slope <= GOAL_MIB_PER_MIN) if len(rss) >= 3 else None,
                # None: too few samples after the warm-up (a process that ended, e.g. the loader).
            }
        )
    total = sum(r["cpu_s"] for r in rows) or 1.0
    for r in rows:
        r["cpu_share"] = r["cpu_s"] / total
    return rows


def add_per_version(rows: list[dict[str, Any]], versions_per_min: float | None) -> None:
    """KiB per trained version: the slope without the machine's speed in it (a loaded machine
    trains fewer versions a minute, and per-record growth then looks smaller per minute)."""
    for r in rows:
        r["kib_per_version"] = (
            r["rss_slope_mib_per_min"] * 1024 / versions_per_min if versions_per_min else None
        )


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'process':<14} {'RSS warm':>9} {'RSS end':>9} {'MiB/min':>8} {'±':>6} {'2nd half':>8} "
        f"{'anon':>7} {'KiB/ver':>8} {'CPU s':>7} {'share':>6}  goal"
    )
    for r in rows:
        per_version = r.get("kib_per_version")
        print(
            f"{r['process']:<14} {r['rss_warm_mib'] or 0:9.1f} {r['rss_end_mib'] or 0:9.1f} "
            f"{r['rss_slope_mib_per_min']:8.3f} {r['rss_slope_stderr']:6.3f} {r['rss_slope_last_half']:8.3f} "
            f"{r['anon_slope_mib_per_min']:7.3f} {'-' if per_version is None else f'{per_version:.3f}':>8} "
            f"{r['cpu_s']:7.1f} {r['cpu_share']:6.3f}  {_verdict(r['meets_goal'])}"
        )


def _verdict(meets: bool | None) -> str:
    return "-" if meets is None else "ok" if meets else "OVER"


def plot(
    samples: dict[str, list[list[float]]],
    rows: list[dict[str, Any]],
    warmup: float,
    path: Path,
    end: float = math.inf,
) -> None:
    """RSS against time, one panel per process (their sizes differ by 100x), warm-up shaded, the
    fitted line over the measured window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["process"] for r in rows]
    cols = 3
    lines = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(lines, cols, figsize=(13, 3.0 * lines), squeeze=False)
    for ax, row in zip(axes.flat, rows, strict=False):
        pts = samples[row["process"]]
        ts = [p[0] for p in pts]
        ax.plot(ts, [p[2] for p in pts], "-", lw=1.2, color="tab:blue", label="RSS")
        ax.plot(ts, [p[3] for p in pts], "-", lw=0.8, color="tab:grey", label="anonymous RSS")
        ax.axvspan(0, warmup, color="grey", alpha=0.15, lw=0)
        after = [p for p in pts if warmup <= p[0] <= end]
        if after:  # zoomed on the measured window: the start-up's climb would flatten any slope
            lo = min(min(p[2], p[3]) for p in after)
            hi = max(p[2] for p in after)
            ax.set_ylim(lo - 0.05 * (hi - lo) - 1, hi + 0.05 * (hi - lo) + 1)
        if len(after) >= 2 and row["rss_warm_mib"] is not None:
            mt = sum(p[0] for p in after) / len(after)
            my = sum(p[2] for p in after) / len(after)
            b = row["rss_slope_mib_per_min"]
            t0, t1 = after[0][0], after[-1][0]
            ax.plot(
                [t0, t1], [my + b * (t0 - mt), my + b * (t1 - mt)], "--", color="tab:red", lw=1.0, label="fit"
            )
        verdict = _verdict(row["meets_goal"]).lower()
        ax.set_title(
            f"{row['process']}: {row['rss_slope_mib_per_min']:+.3f} MiB/min ({verdict})",
            fontsize=10,
            color="tab:red" if row["meets_goal"] is False else "black",
        )
        ax.set_xlabel("minutes")
        ax.set_ylabel("MiB")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7, loc="lower right")
    fig.suptitle(
        f"RSS per process (shaded: {warmup:g}-minute warm-up, left out of the fit; goal <= "
        f"{GOAL_MIB_PER_MIN} MiB/min)",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def trace_report(trace: Path, pids: dict[int, str], warmup: float, top: int = 8) -> dict[str, Any]:
    """Per traced process: the traced heap's slope and the allocation sites that grew most between
    the first snapshot after the warm-up and the last."""
    import tracemalloc

    out: dict[str, Any] = {}
    by_pid: dict[int, list[tuple[float, Path]]] = {}
    for snap in trace.glob("*.snap"):
        m = re.match(r"(\d+)-\d+-(\d+)s\.snap$", snap.name)
        if m:
            by_pid.setdefault(int(m.group(1)), []).append((int(m.group(2)) / 60, snap))
    for pid, snaps in sorted(by_pid.items()):
        snaps.sort()
        name = pids.get(pid)
        if name is None:
            argv = json.loads((trace / f"{pid}.argv").read_text()) if (trace / f"{pid}.argv").exists() else []
            name = f"pid {pid}: {' '.join(a for a in argv[2:5])}"
        totals = []
        loaded = {}
        for t, path in snaps:
            s = tracemalloc.Snapshot.load(str(path))
            loaded[t] = s
            totals.append((t, sum(st.size for st in s.statistics("filename")) / 2**20))
        after = [t for t, _ in snaps if t >= warmup]
        entry: dict[str, Any] = {
            "traced_mib": totals,
            "traced_slope_mib_per_min": fit([p for p in totals if p[0] >= warmup])[0],
            "growth": [],
        }
        if len(after) >= 2:
            first, last = loaded[after[0]], loaded[after[-1]]
            minutes = after[-1] - after[0]
            for st in last.compare_to(first, "traceback")[:top]:
                if st.size_diff <= 0:
                    continue
                entry["growth"].append(
                    {
                        "kib_per_min": st.size_diff / 1024 / minutes,
                        "count_diff": st.count_diff,
                        "traceback": [f"{f.filename}:{f.lineno}" for f in st.traceback],
                    }
                )
        out[name] = entry
        for s in loaded.values():
            del s
    return out


def print_trace(report: dict[str, Any]) -> None:
    for name, entry in report.items():
        print(f"\n== {name}: traced Python heap {entry['traced_slope_mib_per_min']:+.3f} MiB/min")
        for g in entry["growth"]:
            where = " <- ".join(_short(f) for f in reversed(g["traceback"][-4:]))
            print(f"  {g['kib_per_min']:8.1f} KiB/min {g['count_diff']:+7d} blocks  {where}")


def _short(frame: str) -> str:
    for marker in ("/site-packages/", "/stream_rl/", "/lib/python3"):
        if marker in frame:
            return (
                frame.split(marker, 1)[1]
                if marker != "/stream_rl/"
                else "stream_rl/" + frame.split(marker, 1)[1]
            )
    return frame


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/demo-cpu.yaml")
    ap.add_argument("--minutes", type=float, default=16.0, help="run length")
    ap.add_argument("--warmup", type=float, default=4.0, help="minutes left out of the slopes")
    ap.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="for every process")
    ap.add_argument("--name", default="soak")
    ap.add_argument("--trace", action="store_true", help="tracemalloc in every Python process (see above)")
    ap.add_argument("--trace-every", type=float, default=60.0, help="seconds between snapshots")
    ap.add_argument(
        "--repo",
        type=Path,
        default=REPO,
        help="checkout whose stream_rl runs (e.g. an export of main, for a before/after comparison)",
    )
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="soak-"))
    broker = LocalBroker(work / "kafka", port=free_port())
    state = broker.up(quiet=True)
    wall = args.minutes * 60
    cmd = [
        sys.executable, "-m", "stream_rl.cli", "run", args.config,
        "--set", f"kafka.bootstrap={state.bootstrap}", "--set", f"runs_dir={work / 'runs'}",
        # Enough problems for the whole run at a few steps a second (the demo: 1,000 per epoch).
        "--set", "trainer.max_steps=1000000", "--set", f"loader.epochs={max(5, int(args.minutes * 3) + 2)}",
        "--set", f"launcher.max_wall_s={wall:.0f}", "--set", f"inference.base_port={free_port()}",
        *[x for o in args.overrides for x in ("--set", o)],
    ]  # fmt: skip
    env = dict(os.environ)
    env.update(kv.split("=", 1) for kv in args.env)
    trace = work / "trace"
    if args.trace:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TRACE_DIR), env.get("PYTHONPATH")) if p)
        env["STREAM_RL_SOAK_TRACE"] = str(trace)
        env["STREAM_RL_SOAK_TRACE_EVERY"] = str(args.trace_every)
    log = open(work / "launcher.log", "w")  # noqa: SIM115 - closed at the end
    # `python -m` from the checkout: its own stream_rl (and schemas) come first on the path.
    launcher = subprocess.Popen(cmd, cwd=args.repo, stdout=log, stderr=subprocess.STDOUT, env=env)
    samples: dict[str, list[list[float]]] = {}
    pid_names: dict[int, str] = {}
    t0 = time.monotonic()
    try:
        while launcher.poll() is None:
            time.sleep(args.every)
            now = (time.monotonic() - t0) / 60
            procs = {"launcher": launcher.pid, "broker": state.pid}
            for path in (work / "runs").glob("*/processes.json"):
                with contextlib.suppress(OSError, ValueError):  # being rewritten: next sample
                    procs.update(json.loads(path.read_text()).get("pids", {}))
            tree = _tree()
            named = set(procs.values())
            for name, pid in procs.items():
                pid_names[pid] = name
                # The launcher's own figures, not its children's (they are measured by name).
                measured = _measure(pid, tree, named - {pid})
                if measured is not None and measured[1] > 0:  # a zombie has no RSS
                    cpu, rss, anon = measured
                    samples.setdefault(name, []).append([now, cpu, rss / 2**20, anon / 2**20])
    finally:
        if launcher.poll() is None:
            launcher.terminate()
            launcher.wait(120)
        log.close()
        broker.down(quiet=True)

    rows = summarize(samples, args.warmup, args.minutes)
    versions = _versions(work / "runs", args.warmup)
    add_per_version(rows, versions["per_min"] if versions else None)
    print_table(rows)
    if versions:
        print(f"versions trained: {versions['last']} ({versions['per_min']:.1f}/min after the warm-up)")
    out = REPO / "bench" / "results" / f"{args.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "config": args.config,
        "repo": str(args.repo),
        "overrides": args.overrides,
        "env": args.env,
        "traced": args.trace,
        "minutes": args.minutes,
        "warmup_min": args.warmup,
        "every_s": args.every,
        "goal_mib_per_min": GOAL_MIB_PER_MIN,
        "versions": versions,
        "rows": rows,
        "samples": {"columns": ["minutes", "cpu_s", "rss_mib", "rss_anon_mib"], **samples},
    }
    if args.trace:
        result["trace"] = trace_report(trace, pid_names, args.warmup)
        print_trace(result["trace"])
    out.write_text(json.dumps(result, indent=1))
    png = out.with_suffix(".png")
    plot(samples, rows, args.warmup, png, args.minutes)
    print(f"wrote {out} and {png}; run log {work / 'launcher.log'}")
    return 0


def _versions(runs: Path, warmup: float) -> dict[str, float] | None:
    """The last version the run's timeline records, and versions per minute after the warm-up
    (the timeline's clock starts with the launcher, about when the soak's does)."""
    for path in runs.glob("*/timeline.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        vs = [r for r in rows if r.get("kind") == "version"]
        after = [r for r in vs if r["t"] >= warmup * 60]
        if len(after) >= 2 and after[-1]["t"] > after[0]["t"]:
            per_min = (after[-1]["version"] - after[0]["version"]) / ((after[-1]["t"] - after[0]["t"]) / 60)
            return {"last": vs[-1]["version"], "per_min": per_min}
    return None


if __name__ == "__main__":
    sys.exit(main())
