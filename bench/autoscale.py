"""The shifting-load comparison of `launcher.autoscale` (docs/autoscaling.md): the same run three
times, one after the other, each through the real launcher on one local broker this script starts:

- `autoscale`: one launched server to start, `launcher.autoscale.servers: {min: 1, max: 3}`;
- `fixed-1`: one server; `fixed-3`: three servers.

The load shifts mid-run: the `progression` task's problems are short (`--short-terms` terms, ~5
tokens a term) for the first `--switch-at` versions' worth, then long (median `--long-terms`): the
loader writes the short ones (`loader.max_problems`), and this script appends the long ones to
`problems` behind them (ids `long-...`, the loader's `seq` order continued), so the actors reach
them after `--switch-at` versions.

Per run: the wall time from version 0 to the last version (`--max-steps`, the target), samples
trained, the CPU seconds of the launcher and every process under it (getrusage of the waited
children: servers and stages, not the broker), samples trained per CPU-second, server-seconds
(replicas integrated over the training window) and the autoscaler's decisions. Writes
bench/results/<name>.json, .md (the table) and .png (samples trained and servers against time,
the switch and each decision marked). The model must be warm-started on `progression` (so that
completions follow the problem's length):

    .venv/bin/stream-rl make-model --preset tiny --warm-start progression --out models/tiny-progression
    .venv/bin/python bench/autoscale.py --model models/tiny-progression                 # ~15 min
    .venv/bin/python bench/autoscale.py --max-steps 8 --switch-at 3 --name autoscale-smoke   # smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from stream_rl.common.ports import free_port
from stream_rl.kafka.broker import LocalBroker
from stream_rl.observe.report import load_timeline

RESULTS = Path(__file__).parent / "results"
VARIANTS = {
    "autoscale": {"servers": 1, "autoscale": True},
    "fixed-1": {"servers": 1, "autoscale": False},
    "fixed-3": {"servers": 3, "autoscale": False},
}


def config_for(args: argparse.Namespace, variant: str, run: str, bootstrap: str) -> dict[str, Any]:
    v = VARIANTS[variant]
    short = {
        "num_problems": args.short_problems,
        "median_terms": args.short_terms,
        "sigma": 0.0,
        "min_terms": args.short_terms,
        "max_terms": args.short_terms,
    }
    launcher: dict[str, Any] = {"max_wall_s": args.max_wall, "stall_timeout_s": 300}
    if v["autoscale"]:
        launcher["autoscale"] = {
            "enabled": True,
            "cooldown_s": args.cooldown,
            "sustain": args.sustain,
            "servers": {"min": 1, "max": 3},
            "thresholds": {"occupancy_high": args.occupancy_high, "trainer_starved": args.trainer_starved},
        }
    return {
        "run": run,
        "runs_dir": args.runs_dir,
        "model": {"path": args.model},
        "kafka": {"bootstrap": bootstrap, "partitions": 2},
        "task": {"name": "progression", "params": short},
        "loader": {"max_problems": args.short_problems},
        "actor": {
            "group_size": args.group,
            "max_lag": 2,
            "straggler_guard": False,
            "request_timeout_s": 600,
            "sampling": {"max_tokens": 4 * args.long_max_terms + 8},
        },
        "inference": {"num_servers": v["servers"], "base_port": free_port(), "max_batch": 64},
        "trainer": {
            "samples_per_step": args.step,
            "max_steps": args.max_steps,
            "policy_loss": "ppo",
            "lr": 1.0e-4,
            "bucket_mb": 1,
            "update_timeout_s": 600,
        },
        "launcher": launcher,
    }


def append_long_problems(args: argparse.Namespace, run: str, bootstrap: str, stop: Any) -> int:
    """Wait for the loader's short problems, then write the long ones behind them."""
    from stream_rl.config import KafkaConfig
    from stream_rl.errors import KafkaError
    from stream_rl.kafka.confluent import KafkaTransport
    from stream_rl.kafka.serde import default_serde
    from stream_rl.kafka.topics import PROBLEMS, TopicNames
    from stream_rl.stages.problem_order import SEQ_HEADER
    from stream_rl.tasks import get_task

    names = TopicNames(run=run)
    transport = KafkaTransport.for_run(KafkaConfig(bootstrap=bootstrap), bootstrap)
    topic = names[PROBLEMS]
    while stop() is None:
        try:
            marks = transport.watermarks(topic)
            if sum(h for _, h in marks.values()) >= args.short_problems:
                break
        except KafkaError:
            pass  # not made yet
        time.sleep(0.5)
    else:
        return 0
    partitions = sorted(marks)
    params = {
        "num_problems": args.long_problems,
        "median_terms": args.long_terms,
        "sigma": 0.3,
        "min_terms": max(4, args.long_terms // 2),
        "max_terms": args.long_max_terms,
        "seed": 1,
    }
    task = get_task("progression", params, None)
    serde = default_serde()
    producer = transport.producer(f"bench-long-{run}")
    try:
        for i, problem in enumerate(task.load_problems(run, 1)):
            seq = args.short_problems + i
            long = dataclasses.replace(problem, problem_id=f"long-{problem.problem_id}")
            producer.produce(
                topic,
                serde.encode(long),
                key=long.problem_id,
                headers={SEQ_HEADER: str(seq)},
                partition=partitions[seq % len(partitions)],
            )
        producer.flush()
    finally:
        producer.close()
    return args.long_problems


def run_one(args: argparse.Namespace, variant: str, stamp: str, bootstrap: str, tmp: Path) -> dict[str, Any]:
    run = f"as-{variant}-{stamp}"
    cfg = config_for(args, variant, run, bootstrap)
    path = tmp / f"{run}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "stream_rl.cli", "run", str(path)]
    log = tmp / f"{run}.log"
    print(f"\n== {variant}: {shlex.join(cmd)} (log {log})", flush=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        written = append_long_problems(args, run, bootstrap, proc.poll)
        rc = proc.wait()
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    timeline = load_timeline(Path(args.runs_dir) / run / "timeline.jsonl")
    return {"variant": variant, "run": run, "rc": rc, "wall_s": wall, "cpu_s": cpu, "long_written": written,
            **analyze(timeline, args, VARIANTS[variant]["servers"])}  # fmt: skip


def analyze(timeline: list[dict[str, Any]], args: argparse.Namespace, start_servers: int) -> dict[str, Any]:
    versions: dict[int, dict[str, Any]] = {}
    for r in timeline:
        if r.get("kind") == "version":
            versions.setdefault(r["version"], r)
    if 0 not in versions:
        return {}
    t0 = versions[0]["t"]
    last = versions[max(versions)]
    window = last["t"] - t0
    switch = versions.get(args.switch_at)
    replicas = [(r["t"], r["replicas"]["server"]) for r in timeline if r.get("kind") == "replicas"]
    decisions = [r for r in timeline if r.get("kind") == "autoscale"]
    # Server-seconds over the training window: the replicas between samples held constant.
    points = [(t0, start_servers)] + [(t, n) for t, n in replicas if t0 < t < last["t"]] + [(last["t"], 0)]
    held = [(t, n) for t, n in replicas if t <= t0]
    if held:
        points[0] = (t0, held[-1][1])
    server_s = sum((b[0] - a[0]) * a[1] for a, b in zip(points, points[1:], strict=False))
    return {
        "versions": max(versions),
        "reached_target": max(versions) >= args.max_steps,
        "time_to_target_s": window if max(versions) >= args.max_steps else None,
        "samples_trained": last["samples_trained"],
        "switch_s": None if switch is None else switch["t"] - t0,
        "server_s": server_s,
        "max_servers": max([n for _, n in replicas] + [start_servers]),
        "decisions": [
            {k: d.get(k) for k in ("t", "role", "before", "after", "signal", "reason", "error")}
            | {"t": d["t"] - t0}
            for d in decisions
        ],
        "curve": [(v["t"] - t0, v["samples_trained"]) for _, v in sorted(versions.items())],
        "servers": [(t - t0, n) for t, n in replicas],
        "lag_mean": sum(float(v.get("version_lag_mean", 0)) for v in versions.values() if v["version"])
        / max(len(versions) - 1, 1),
    }


def table(runs: list[dict[str, Any]]) -> str:
    def f(x: Any, spec: str = ".1f") -> str:
        return "-" if not isinstance(x, int | float) else format(x, spec)

    rows = ["| run | versions | time to target (s) | samples | CPU s | samples / CPU-s | server-s | max servers | decisions |",
            "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in runs:
        spc = r["samples_trained"] / r["cpu_s"] if r.get("samples_trained") and r["cpu_s"] else None
        moves = ", ".join(
            f"{d['before']}->{d['after']}@{d['t']:.0f}s ({d['signal']})" for d in r.get("decisions", [])
        )
        rows.append(
            f"| {r['variant']} | {r.get('versions', '-')} | {f(r.get('time_to_target_s'))} | {r.get('samples_trained', '-')} "
            f"| {f(r['cpu_s'])} | {f(spc, '.2f')} | {f(r.get('server_s'), '.0f')} | {r.get('max_servers', '-')} | {moves or '-'} |"
        )  # fmt: skip
    return "\n".join(rows)


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for r in runs:
        if not r.get("curve"):
            continue
        (line,) = top.plot([c[0] for c in r["curve"]], [c[1] for c in r["curve"]], "-", label=r["variant"])
        if r.get("switch_s") is not None:
            top.axvline(r["switch_s"], color=line.get_color(), ls=":", alpha=0.6)
        steps = r["servers"] or []
        start = VARIANTS[r["variant"]]["servers"]
        xs = [0.0] + [s[0] for s in steps if s[0] > 0] + [r["curve"][-1][0]]
        ys = [start] + [s[1] for s in steps if s[0] > 0]
        ys.append(ys[-1])
        bottom.step(xs, ys, where="post", color=line.get_color(), label=r["variant"])
        for d in r.get("decisions", []):
            bottom.annotate(
                d["signal"], (d["t"], d["after"]), fontsize=7, xytext=(3, 3), textcoords="offset points"
            )
            bottom.plot(
                [d["t"]], [d["after"]], "^" if d["after"] > d["before"] else "v", color=line.get_color()
            )
    top.set(ylabel="samples trained", title="shifting load: short problems, then long (dotted: the switch)")
    top.legend()
    bottom.set(
        xlabel="seconds since version 0", ylabel="servers", ylim=(0, 3.6),
        title="servers (line: in force; marker: the decision, labelled with its signal)",
    )  # fmt: skip
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", default="models/tiny-progression", help="a tiny model warm-started on progression"
    )
    ap.add_argument("--max-steps", type=int, default=30, help="versions of every run (the target)")
    ap.add_argument("--switch-at", type=int, default=10, help="versions' worth of short problems")
    ap.add_argument("--step", type=int, default=32, help="trainer.samples_per_step")
    ap.add_argument("--group", type=int, default=8, help="actor.group_size")
    ap.add_argument("--short-terms", type=int, default=4)
    ap.add_argument("--long-terms", type=int, default=40, help="median terms of the long problems")
    ap.add_argument("--long-max-terms", type=int, default=96)
    ap.add_argument("--cooldown", type=float, default=20.0, help="launcher.autoscale.cooldown_s")
    ap.add_argument("--sustain", type=int, default=2, help="launcher.autoscale.sustain")
    ap.add_argument(
        "--occupancy-high", type=float, default=0.6, help="launcher.autoscale.thresholds.occupancy_high"
    )
    ap.add_argument(
        "--trainer-starved", type=float, default=0.7, help="launcher.autoscale.thresholds.trainer_starved"
    )
    ap.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}"
    )
    ap.add_argument("--max-wall", type=float, default=900.0, help="stop a run after this many seconds")
    ap.add_argument("--runs-dir", default="runs")
    ap.add_argument("--name", default="autoscale", help="bench/results/<name>.json|md|png")
    args = ap.parse_args()
    if not (Path(args.model) / "config.json").is_file():
        ap.error(
            f"--model {args.model}: no model there; make one with `stream-rl make-model --preset tiny "
            f"--warm-start progression --out {args.model}`"
        )
    if not 0 < args.switch_at < args.max_steps:
        ap.error("--switch-at must be between 0 and --max-steps")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if unknown := [v for v in variants if v not in VARIANTS]:
        ap.error(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    args.short_problems = args.switch_at * args.step // args.group
    args.long_problems = (args.max_steps - args.switch_at) * args.step // args.group + 8
    stamp = time.strftime("%m%d-%H%M%S")
    with tempfile.TemporaryDirectory(prefix="bench-autoscale-") as tmp:
        broker = LocalBroker(Path(tmp) / "kafka", port=free_port())
        bootstrap = broker.up(quiet=True).bootstrap
        try:
            runs = [run_one(args, v, stamp, bootstrap, Path(tmp)) for v in variants]
        finally:
            broker.down(quiet=True)
    RESULTS.mkdir(exist_ok=True)
    result = {"command": shlex.join([Path(sys.executable).name, *sys.argv]), "args": vars(args), "runs": runs}
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    md = table(runs)
    (RESULTS / f"{args.name}.md").write_text(md + "\n")
    plot(runs, RESULTS / f"{args.name}.png")
    print("\n" + md)
    print(f"\nwrote {RESULTS / args.name}.json, .md, .png")
    return 0 if all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
