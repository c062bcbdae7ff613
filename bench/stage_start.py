"""Stages forked from the launcher's fork server vs. started as programs (`launcher.fork_stages`).

Per repeat, both sides in turn (alternating which goes first) on one broker this script starts:
a short CPU run of the tiny model through `stream-rl run` (4 steps, every stage its own
process), measuring the run's wall time and the CPU of the launcher's whole process tree (the
launcher reaps its children and the fork server its forks, so `RUSAGE_CHILDREN` of this process
holds all of it; the broker is not in it). Reports medians and the ratio fork / programs.

    python bench/stage_start.py [--repeats 3] [--steps 4]

Writes bench/results/stage_start.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from stream_rl.common.ports import free_port
from stream_rl.inference.model_maker import make_model
from stream_rl.kafka.broker import LocalBroker

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "stage_start.json"
SIDES = ("auto", "off")


def _children_cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def one_run(work: Path, model: Path, bootstrap: str, mode: str, steps: int) -> dict[str, Any]:
    run = f"bench-{mode}-{uuid.uuid4().hex[:6]}"
    cfg = {
        "run": run,
        "runs_dir": str(work / "runs"),
        "model": {"path": str(model)},
        "kafka": {"bootstrap": bootstrap, "partitions": 2},
        "task": {"name": "arithmetic", "params": {"num_problems": 200}},
        "actor": {"group_size": 4, "max_lag": 1, "sampling": {"max_tokens": 4}},
        "inference": {"num_servers": 1, "base_port": free_port(), "max_batch": 32},
        "trainer": {"samples_per_step": 16, "max_steps": steps},
        "launcher": {"max_wall_s": 300, "fork_stages": mode},
    }
    path = work / f"{run}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cpu0, t0 = _children_cpu(), time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "stream_rl.cli", "run", str(path)], cwd=REPO, capture_output=True, text=True
    )
    wall, cpu = time.monotonic() - t0, _children_cpu() - cpu0
    if proc.returncode != 0:
        raise SystemExit(
            f"run {run} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        )
    summary = json.loads((work / "runs" / run / "summary.json").read_text())
    assert summary["versions"]["last"] == steps, summary["versions"]
    return {"mode": mode, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = make_model(work / "model", "tiny", seed=0)
        broker = LocalBroker(work / "kafka", port=free_port())
        bootstrap = broker.up(quiet=True).bootstrap
        rows: list[dict[str, Any]] = []
        try:
            for i in range(args.repeats):
                order = SIDES if i % 2 == 0 else SIDES[::-1]
                for mode in order:
                    row = one_run(work, model, bootstrap, mode, args.steps)
                    rows.append({"repeat": i, **row})
                    print(
                        f"repeat {i + 1}/{args.repeats} fork_stages={mode}: {row['wall_s']} s, {row['cpu_s']} CPU-s",
                        flush=True,
                    )
        finally:
            broker.down(quiet=True)
    med = {
        m: {k: statistics.median(r[k] for r in rows if r["mode"] == m) for k in ("wall_s", "cpu_s")}
        for m in SIDES
    }
    ratio = {k: round(med["auto"][k] / med["off"][k], 3) for k in ("wall_s", "cpu_s")}
    print(f"\n{'launcher.fork_stages':<22}{'wall s (median)':>16}{'CPU-s (median)':>16}")
    for m in SIDES:
        print(f"{m:<22}{med[m]['wall_s']:>16.1f}{med[m]['cpu_s']:>16.1f}")
    print(f"{'ratio auto / off':<22}{ratio['wall_s']:>16.2f}{ratio['cpu_s']:>16.2f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {"steps": args.steps, "repeats": args.repeats, "runs": rows, "median": med, "ratio": ratio},
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
