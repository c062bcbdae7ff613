"""Soak: run a config through the launcher for a while, sample every process's memory and CPU.

    .venv/bin/python bench/soak.py [--config configs/demo-cpu.yaml] [--minutes 15] [--warmup 2]

It starts its own broker (so the broker's pid is known), launches the run with a large step
budget and `launcher.max_wall_s`, and every `--every` seconds reads, for the launcher, the broker
and each child of `processes.json` (restarted children included), the resident set (VmRSS, with
its descendants: the verifier's scoring workers) and the user+system CPU time (from /proc).

Reported per process: RSS at the end of the warm-up and at the end, the least-squares RSS slope
after the warm-up (MiB/min; issue 15's goal: <= 0.05 for every process), the CPU seconds over the
measured window and their share of all processes' CPU (issue 12's broker goal: <= 0.05). Prints a
table and writes `bench/results/<name>.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from stream_rl.kafka.broker import LocalBroker, free_port  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def _stat(pid: int) -> tuple[int, float, int] | None:
    """(ppid, cpu seconds, rss bytes) of a live process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw.rsplit(")", 1)[1].split()
    ppid, utime, stime, rss_pages = int(fields[1]), int(fields[11]), int(fields[12]), int(fields[21])
    return ppid, (utime + stime) / TICK, rss_pages * PAGE


def _tree() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is not None:
                children.setdefault(st[0], []).append(int(entry.name))
    return children


def _measure(pid: int, tree: dict[int, list[int]], exclude: set[int]) -> tuple[float, int] | None:
    """CPU seconds and RSS of `pid` and its descendants (not those in `exclude`); None when gone."""
    if _stat(pid) is None:
        return None
    cpu, rss, todo = 0.0, 0, [pid]
    while todo:
        p = todo.pop()
        st = _stat(p)
        if st is None:
            continue
        cpu += st[1]
        rss += st[2]
        todo.extend(c for c in tree.get(p, []) if c not in exclude)
    return cpu, rss


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (t, y)."""
    n = len(points)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    den = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (y - my) for t, y in points) / den if den else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/demo-cpu.yaml")
    ap.add_argument("--minutes", type=float, default=15.0, help="run length")
    ap.add_argument("--warmup", type=float, default=2.0, help="minutes left out of the slopes")
    ap.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--name", default="soak")
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
    log = open(work / "launcher.log", "w")  # noqa: SIM115 - closed at the end
    # `python -m` from the checkout: its own stream_rl (and schemas) come first on the path.
    launcher = subprocess.Popen(cmd, cwd=args.repo, stdout=log, stderr=subprocess.STDOUT)
    samples: dict[str, list[tuple[float, float, int]]] = {}
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
                # The launcher's own figures, not its children's (they are measured by name).
                measured = _measure(pid, tree, named - {pid})
                if measured is not None and measured[1] > 0:  # a zombie has no RSS
                    samples.setdefault(name, []).append((now, *measured))
    finally:
        if launcher.poll() is None:
            launcher.terminate()
            launcher.wait(120)
        log.close()
        broker.down(quiet=True)

    rows = []
    for name, pts in sorted(samples.items()):
        after = [(t, rss / 2**20) for t, _cpu, rss in pts if t >= args.warmup]
        window = [p for p in pts if p[0] >= args.warmup]
        cpu = max(window[-1][1] - window[0][1], 0.0) if len(window) > 1 else 0.0
        rows.append(
            {
                "process": name,
                "rss_warm_mib": after[0][1] if after else None,
                "rss_end_mib": after[-1][1] if after else None,
                "rss_slope_mib_per_min": slope(after),
                "cpu_s": cpu,
            }
        )
    total = sum(r["cpu_s"] for r in rows) or 1.0
    for r in rows:
        r["cpu_share"] = r["cpu_s"] / total
    print(f"{'process':<16} {'RSS warm':>9} {'RSS end':>9} {'MiB/min':>8} {'CPU s':>8} {'share':>6}")
    for r in rows:
        print(
            f"{r['process']:<16} {r['rss_warm_mib'] or 0:9.1f} {r['rss_end_mib'] or 0:9.1f} "
            f"{r['rss_slope_mib_per_min']:8.3f} {r['cpu_s']:8.1f} {r['cpu_share']:6.3f}"
        )
    out = REPO / "bench" / "results" / f"{args.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "config": args.config,
        "repo": str(args.repo),
        "overrides": args.overrides,
        "minutes": args.minutes,
        "warmup_min": args.warmup,
        "rows": rows,
    }
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}; run log {work / 'launcher.log'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
