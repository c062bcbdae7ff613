"""PipelineRL's comparison on this machine: the same task, model, seed and hyper-parameters run
to the same number of samples in each mode below, one after the other, each through the
real launcher (`stream-rl run CONFIG --set ...`, its own local broker on a free port):

- `conventional`: `mode: conventional` (one step's worth of samples per version, lag 0, weights
  change only between batches);
- `pipeline`: `mode: pipeline` with in-flight weight updates (the servers swap weights between
  two decode steps, running sequences included);
- `pipeline-recompute`: in-flight updates with `inference.kv_policy: recompute` (the servers
  rebuild the running sequences' KV cache under the new weights at each swap);
- `pipeline-no-inflight`: `mode: pipeline`, `in_flight_updates: false` (the servers hold new
  sequences, let the running ones finish on the old weights, then swap), to isolate what
  in-flight updates buy;
- `pipeline-guard` (an ablation, not run by default): pipeline with `actor.straggler_guard: true`,
  for configs that turn it off.

Per run it reports, over the training window (from the publication of version 0 to that of the
last version, so start-up, identical in every mode, is left out): wall time until the centred
moving mean (over `--window` versions) of the trained samples' reward reaches `--target`, the
generated samples/s and tokens/s, the trainer's busy fraction (forward/backward/optimizer time
over the window; broadcasts apart), the inference engine's idle fraction (its decode loop's
busy seconds), version lag (mean, max), ESS (mean, min), the final reward, and the CPU each
stage used (`bench/run_probe.py`), the engine's batch occupancy (running sequences / max batch,
from the servers' `/metrics`) and the per-sample version-lag distribution. Then per mode the
medians over repeats with their min-max, and the ratios against pipeline. Repeats rotate the
order of the modes (repeat r starts with the r-th mode), so no mode always runs first or last
on a machine whose load drifts.

    .venv/bin/python bench/pipeline_vs_conventional.py                       # the comparison (~30 min)
    .venv/bin/python bench/pipeline_vs_conventional.py --max-steps 10 --target 0.3   # smoke (~5 min)
    .venv/bin/python bench/pipeline_vs_conventional.py --repeats 2 --set trainer.samples_per_step=64
    .venv/bin/python bench/pipeline_vs_conventional.py --analyze-only        # re-read the last runs

Writes bench/results/<name>.json, <name>.md (the per-mode table), <name>.png (reward against wall
time and against samples trained, every mode on one plot) and <name>_occupancy.png (batch
occupancy against time for the first run of each mode, and the lag distributions); each run
stays in runs/<run>/ (its probe samples in probe.jsonl).

    .venv/bin/python bench/pipeline_vs_conventional.py --config configs/long-cpu.yaml \
        --modes conventional,pipeline,pipeline-recompute,pipeline-no-inflight --repeats 2 \
        --max-steps 10 --pin-trainer-cpu 1 --target 0.3 --max-wall 700 --name long-cpu   # docs/performance.md (~30 min)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pvc_plots import plot, plot_occupancy
from run_probe import RunProbe, analyze, fmt, machine_busy_s
from run_watch import completion_lengths, target_reached

from stream_rl.common.ports import free_port
from stream_rl.config import load_config
from stream_rl.kafka.broker import LocalBroker
from stream_rl.observe.report import load_timeline

RESULTS = Path(__file__).parent / "results"
MODES: dict[str, list[str]] = {
    "conventional": ["mode=conventional"],
    "pipeline": ["mode=pipeline", "in_flight_updates=true", "inference.kv_policy=keep"],
    "pipeline-recompute": ["mode=pipeline", "in_flight_updates=true", "inference.kv_policy=recompute"],
    "pipeline-no-inflight": ["mode=pipeline", "in_flight_updates=false"],
    # an ablation for configs that turn the guard off: pipeline with the admission window held by
    # generating stragglers (stream_rl/stages/admission.py)
    "pipeline-guard": ["mode=pipeline", "in_flight_updates=true", "actor.straggler_guard=true"],
}
DEFAULT_MODES = ["conventional", "pipeline", "pipeline-no-inflight"]


def machine_load(seconds: float = 3.0) -> dict[str, Any]:
    """Load averages and the cores busy over the next `seconds` (all processes of the machine)."""
    before = machine_busy_s()
    time.sleep(seconds)
    return {
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "cores_busy": round((machine_busy_s() - before) / seconds, 2),
        "cores": os.cpu_count(),
        "at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def epochs_needed(config_path: str, overrides: list[str], max_steps: int) -> int:
    """Loader epochs so that problems never run out before `max_steps` (with a margin)."""
    from stream_rl.tasks import get_task

    cfg = load_config(config_path, overrides)
    task = get_task(cfg.task.name, cfg.task.params, cfg.task.system_prompt)
    problems = len(task.load_problems(cfg.run, cfg.seed))
    if cfg.loader.max_problems is not None:
        problems = min(problems, cfg.loader.max_problems)
    steps = max_steps + cfg.actor.max_lag + 2
    needed = steps * cfg.trainer.samples_per_step / cfg.actor.group_size
    return max(cfg.loader.epochs, math.ceil(needed / problems))


def run_one(args: argparse.Namespace, mode: str, repeat: int, stamp: str, epochs: int) -> dict[str, Any]:
    """Launch one run, probe it while it goes, and analyse it."""
    run = f"pvc-{stamp}-{mode}-r{repeat}"
    runs_dir = Path(args.runs_dir)
    run_dir = runs_dir / run
    run_dir.mkdir(parents=True, exist_ok=True)
    broker_dir = Path(tempfile.mkdtemp(prefix=f"{run}-kafka-"))
    # The run's own broker, started here rather than by the launcher (which then leaves it
    # running) so that the scored rollouts can be read after the run: the completion lengths.
    broker = LocalBroker(broker_dir, port=free_port())
    bootstrap = broker.up(quiet=True).bootstrap
    overrides = [
        *args.overrides,
        *MODES[mode],
        f"run={run}",
        f"runs_dir={args.runs_dir}",
        f"trainer.max_steps={args.max_steps}",
        f"loader.epochs={epochs}",
        f"kafka.port={broker.port}",
        f"kafka.data_dir={broker_dir}",
        f"inference.base_port={free_port()}",
        "trainer.sync_master_port=0",
        f"launcher.max_wall_s={args.max_wall}",
    ]
    cmd = [sys.executable, "-m", "stream_rl.cli", "run", args.config]
    for item in overrides:
        cmd += ["--set", item]
    env = {k: v for k, v in os.environ.items() if k != "STREAM_RL_KAFKA_BOOTSTRAP"}  # own broker
    print(f"\n[{time.strftime('%H:%M:%S')}] {mode} (repeat {repeat}): {run_dir}/launcher.log", flush=True)
    started = time.time()
    with open(run_dir / "launcher.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    pin = {args.pin_trainer_cpu} if args.pin_trainer_cpu is not None else None
    probe = RunProbe(run_dir, proc.pid, broker_dir, every_s=args.probe_every, pin_trainer=pin)
    probe.start()
    stopped_at = None
    try:
        while (rc := proc.poll()) is None:
            if args.stop_at_target and (stopped_at := target_reached(run_dir, args.target, args.window)):
                print(f"  target reached at version {stopped_at}: stopping the run", flush=True)
                proc.terminate()  # the launcher stops its children and writes its summary
                rc = proc.wait(timeout=120)
                break
            time.sleep(1.0)
    finally:
        if proc.poll() is None:  # interrupted: the launcher stops its children on SIGTERM
            proc.terminate()
            proc.wait(timeout=120)
        probe.stop()
        try:
            lengths = completion_lengths(run_dir, bootstrap)
        finally:
            broker.down(quiet=True)
            shutil.rmtree(broker_dir, ignore_errors=True)
    with open(run_dir / "probe.jsonl", "w") as f:
        for sample in probe.samples:
            f.write(json.dumps(sample) + "\n")
    result = {"mode": mode, "repeat": repeat, "run": run, "rc": rc, "launch_s": time.time() - started}
    result["stopped_at_target_version"] = stopped_at
    result["completion_tokens"] = lengths
    for key in ("p50", "p99", "mean", "cut_at_max_tokens"):
        result[f"completion_{key}"] = lengths.get(key)
    result["command"] = shlex.join(["stream-rl", "run", args.config, *[f"--set={o}" for o in overrides]])
    result.update(analyze_run(run_dir, args.target, args.window))
    print(f"  rc {rc}, {one_line(result)}", flush=True)
    return result


def analyze_run(run_dir: Path, target: float, window: int) -> dict[str, Any]:
    timeline = load_timeline(run_dir / "timeline.jsonl")
    probe = run_dir / "probe.jsonl"
    samples = [json.loads(line) for line in probe.read_text().splitlines()] if probe.exists() else []
    summary = (
        json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    )
    return {"exit_reason": summary.get("exit_reason"), **analyze(timeline, samples, target, window)}


def one_line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"error: {r['error']}"
    return (
        f"to target {fmt(r['time_to_target_s'], '.1f')} s, final reward {fmt(r['final_reward'])}, "
        f"{fmt(r['trained_samples_per_s'], '.1f')} samples/s, lag {fmt(r['version_lag_mean'])}/"
        f"{fmt(r['version_lag_max'], '.0f')}, ESS {fmt(r['ess_mean'], '.3f')}, completion tokens p50/p99 "
        f"{fmt(r.get('completion_p50'), '.0f')}/{fmt(r.get('completion_p99'), '.0f')}"
    )


def median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def spread(runs: list[dict[str, Any]], key: str) -> list[float] | None:
    """[min, max] over the runs that have the figure."""
    values = [r[key] for r in runs if r.get(key) is not None]
    return [min(values), max(values)] if values else None


def aggregate(runs: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """Per mode: medians over repeats; ratios conventional / pipeline (and the third mode)."""
    modes: dict[str, Any] = {}
    keys = [
        "time_to_target_s", "final_reward", "window_s", "trained_samples_per_s", "generated_samples_per_s",
        "generated_tokens_per_s", "trainer_busy", "trainer_broadcast", "inference_idle", "step_s_mean",
        "version_lag_mean", "version_lag_token_mean", "ess_mean", "samples_at_target", "other_work_cores",
        "samples_per_cpu_s", "cpu_s_to_target", "occupancy", "lag_p50", "lag_p90", "lag_p99",
        "version_lag_last_mean", "broker_share", "completion_p50", "completion_p99", "completion_mean",
        "completion_cut_at_max_tokens",
    ]  # fmt: skip
    for mode in MODES:
        of = [r for r in runs if r["mode"] == mode and "error" not in r]
        if of:
            modes[mode] = {k: median(of, k) for k in keys}
            modes[mode]["range"] = {k: spread(of, k) for k in keys}
            counts: dict[str, int] = {}
            for r in of:
                for lag, n in r.get("lag_counts", {}).items():
                    counts[lag] = counts.get(lag, 0) + n
            modes[mode]["lag_counts"] = dict(sorted(counts.items(), key=lambda kv: int(kv[0])))
            modes[mode]["version_lag_max"] = max((r["version_lag_max"] or 0) for r in of)
            modes[mode]["ess_min"] = min((r["ess_min"] for r in of if r["ess_min"] is not None), default=None)
            modes[mode]["reached_target"] = sum(r["time_to_target_s"] is not None for r in of)
            modes[mode]["runs"] = len(of)

    def ratio(a: str, b: str, key: str) -> float | None:
        x, y = modes.get(a, {}).get(key), modes.get(b, {}).get(key)
        return x / y if x is not None and y else None

    ratios = {
        "time_to_target_pipeline_over_conventional": ratio("pipeline", "conventional", "time_to_target_s"),
        "time_to_target_pipeline_over_no_inflight": ratio(
            "pipeline", "pipeline-no-inflight", "time_to_target_s"
        ),
        "time_to_target_recompute_over_pipeline": ratio("pipeline-recompute", "pipeline", "time_to_target_s"),
        "occupancy_pipeline_over_conventional": ratio("pipeline", "conventional", "occupancy"),
        "time_to_target_conventional_over_pipeline": ratio("conventional", "pipeline", "time_to_target_s"),
        "time_to_target_no_inflight_over_pipeline": ratio(
            "pipeline-no-inflight", "pipeline", "time_to_target_s"
        ),
        "time_to_target_conventional_over_no_inflight": ratio(
            "conventional", "pipeline-no-inflight", "time_to_target_s"
        ),
        "throughput_pipeline_over_conventional": ratio("pipeline", "conventional", "trained_samples_per_s"),
        "samples_to_target_pipeline_over_conventional": ratio(
            "pipeline", "conventional", "samples_at_target"
        ),
        "cpu_s_to_target_conventional_over_pipeline": ratio("conventional", "pipeline", "cpu_s_to_target"),
        "samples_per_cpu_s_pipeline_over_conventional": ratio(
            "pipeline", "conventional", "samples_per_cpu_s"
        ),
    }
    p = modes.get("pipeline", {})
    conv_over_pipe = ratios["time_to_target_conventional_over_pipeline"]

    def at_most(value: float | None, limit: float) -> bool:
        return value is not None and value <= limit

    # Issue 31's goals: time to target pipeline / conventional <= 0.6, pipeline /
    # pipeline-no-inflight <= 0.85, samples to target pipeline / conventional <= 1.2, the broker
    # <= 5 % of the run's CPU (pipeline mode, over the training window).
    goal = {
        "pipeline_time_fraction": 1 / conv_over_pipe if conv_over_pipe else None,
        "time_ok": bool(conv_over_pipe and 1 / conv_over_pipe <= 0.6),
        "inflight_ok": at_most(ratios["time_to_target_pipeline_over_no_inflight"], 0.85),
        "samples_ok": at_most(ratios["samples_to_target_pipeline_over_conventional"], 1.2),
        "broker_share": p.get("broker_share"),
        "broker_ok": at_most(p.get("broker_share"), 0.05),
        "max_lag_ok": p.get("version_lag_max") is not None and p["version_lag_max"] <= 2,
        "ess_ok": p.get("ess_mean") is not None and p["ess_mean"] >= 0.9,
    }
    return {"modes": modes, "ratios": ratios, "goal": goal, "target": target}


def print_tables(runs: list[dict[str, Any]], agg: dict[str, Any]) -> None:
    head = (
        f"{'mode':<21}{'rep':>4}{'to target s':>12}{'final R':>9}{'samples/s':>10}{'gen tok/s':>10}"
        f"{'trainer busy':>13}{'infer idle':>11}{'lag mean/max':>13}{'ESS mean/min':>14}{'window s':>9}"
        f"{'samples/CPU-s':>14}{'CPU-s to tgt':>13}{'occupancy':>10}{'lag p50/p90/p99':>16}"
    )
    print("\n" + head + "\n" + "-" * len(head))
    for r in runs:
        if "error" in r:
            print(f"{r['mode']:<21}{r['repeat']:>4}  {r['error']}")
            continue
        print(
            f"{r['mode']:<21}{r['repeat']:>4}{fmt(r['time_to_target_s'], '.1f'):>12}{fmt(r['final_reward']):>9}"
            f"{fmt(r['generated_samples_per_s'], '.1f'):>10}{fmt(r['generated_tokens_per_s'], '.0f'):>10}"
            f"{fmt(r['trainer_busy']):>13}{fmt(r['inference_idle']):>11}"
            f"{fmt(r['version_lag_mean']) + '/' + fmt(r['version_lag_max'], '.0f'):>13}"
            f"{fmt(r['ess_mean'], '.3f') + '/' + fmt(r['ess_min'], '.2f'):>14}{fmt(r['window_s'], '.0f'):>9}"
            f"{fmt(r.get('samples_per_cpu_s'), '.1f'):>14}{fmt(r.get('cpu_s_to_target'), '.0f'):>13}"
            f"{fmt(r.get('occupancy')):>10}"
            f"{fmt(r.get('lag_p50'), '.0f') + '/' + fmt(r.get('lag_p90'), '.0f') + '/' + fmt(r.get('lag_p99'), '.0f'):>16}"
        )
    print("\nCPU cores used over the training window, per stage (and by other work on the machine):")
    roles = sorted({k for r in runs if "cpu_cores" in r for k in r["cpu_cores"]})
    print(f"{'mode':<21}{'rep':>4}" + "".join(f"{x:>13}" for x in [*roles, "other work"]))
    for r in runs:
        if "cpu_cores" in r:
            cells = [fmt(r["cpu_cores"].get(x)) for x in roles] + [fmt(r.get("other_work_cores"))]
            print(f"{r['mode']:<21}{r['repeat']:>4}" + "".join(f"{c:>13}" for c in cells))
    print()
    for name, value in agg["ratios"].items():
        print(f"{name:<48} {fmt(value)}")
    g = agg["goal"]
    r = agg["ratios"]

    def ok(flag: bool) -> str:
        return "ok" if flag else "not met"

    print(
        f"goals: time to target pipeline / conventional <= 0.6: {fmt(g['pipeline_time_fraction'])} "
        f"({ok(g['time_ok'])}); pipeline / no-inflight <= 0.85: "
        f"{fmt(r['time_to_target_pipeline_over_no_inflight'])} ({ok(g['inflight_ok'])}); samples to target "
        f"pipeline / conventional <= 1.2: {fmt(r['samples_to_target_pipeline_over_conventional'])} "
        f"({ok(g['samples_ok'])}); broker share of the run's CPU <= 0.05: {fmt(g['broker_share'])} "
        f"({ok(g['broker_ok'])}); max lag <= 2: {ok(g['max_lag_ok'])}; ESS >= 0.9: {ok(g['ess_ok'])}"
    )


def cell(m: dict[str, Any], key: str, spec: str) -> str:
    """`median (min-max)` of a mode's figure."""
    value, span = m.get(key), m.get("range", {}).get(key)
    if value is None:
        return "-"
    if not span or m.get("runs", 1) < 2 or format(span[0], spec) == format(span[1], spec):
        return fmt(value, spec)
    return f"{fmt(value, spec)} ({fmt(span[0], spec)}–{fmt(span[1], spec)})"


def markdown(agg: dict[str, Any]) -> str:
    """The per-mode medians (min–max over repeats) and the ratios as Markdown (for the README)."""
    rows = [
        "| mode | runs | time to target (s) | samples to target | final reward | trained samples/s "
        "| generated tokens/s | engine occupancy | trainer busy | inference idle | version lag mean / max "
        "| lag p50 / p90 / p99 | ESS mean / min | completion tokens p50 / p99 | broker share of CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, m in agg["modes"].items():
        rows.append(
            f"| {mode} | {m['runs']} | {cell(m, 'time_to_target_s', '.1f')} | {cell(m, 'samples_at_target', '.0f')} "
            f"| {cell(m, 'final_reward', '.2f')} | {cell(m, 'trained_samples_per_s', '.1f')} "
            f"| {cell(m, 'generated_tokens_per_s', '.0f')} | {cell(m, 'occupancy', '.2f')} "
            f"| {fmt(m['trainer_busy'])} | {fmt(m['inference_idle'])} "
            f"| {fmt(m['version_lag_mean'])} / {fmt(m['version_lag_max'], '.0f')} "
            f"| {fmt(m['lag_p50'], '.0f')} / {fmt(m['lag_p90'], '.0f')} / {fmt(m['lag_p99'], '.0f')} "
            f"| {fmt(m['ess_mean'], '.3f')} / {fmt(m['ess_min'], '.2f')} "
            f"| {fmt(m['completion_p50'], '.0f')} / {fmt(m['completion_p99'], '.0f')} "
            f"| {cell(m, 'broker_share', '.3f')} |"
        )
    r = agg["ratios"]
    rows += [
        "",
        f"Medians over repeats (min–max in brackets). Time to target, pipeline / conventional: "
        f"**{fmt(r['time_to_target_pipeline_over_conventional'])}×**; pipeline / pipeline-no-inflight: "
        f"**{fmt(r['time_to_target_pipeline_over_no_inflight'])}×**; pipeline-recompute / pipeline: "
        f"{fmt(r['time_to_target_recompute_over_pipeline'])}×; samples to target, pipeline / conventional: "
        f"{fmt(r['samples_to_target_pipeline_over_conventional'])}×; trained samples/s, pipeline / "
        f"conventional: {fmt(r['throughput_pipeline_over_conventional'])}×.",
    ]
    return "\n".join(rows) + "\n"


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through run_one's `finally`: the launcher is stopped


def main() -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/demo-cpu.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="config override applied to every mode (repeatable)")  # fmt: skip
    ap.add_argument("--max-steps", type=int, default=100, help="optimizer steps of every run (same samples)")
    ap.add_argument("--target", type=float, default=0.8, help="target reward (centred moving mean)")
    ap.add_argument("--window", type=int, default=5, help="versions in the reward's moving mean")
    ap.add_argument(
        "--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated, of {', '.join(MODES)}"
    )
    ap.add_argument("--repeats", type=int, default=1, help="runs per mode (the order rotates each repeat)")
    ap.add_argument(
        "--stop-at-target",
        action="store_true",
        help="stop each run once its centred mean has reached --target (--max-steps stays the cap)",
    )
    ap.add_argument("--max-wall", type=float, default=3600.0, help="stop a run after this many seconds")
    ap.add_argument("--probe-every", type=float, default=1.0, help="probe sampling period (s)")
    ap.add_argument(
        "--pin-trainer-cpu",
        type=int,
        default=None,
        metavar="CPU",
        help="pin the trainer to this CPU and the inference servers to the others (separate devices)",
    )
    ap.add_argument("--runs-dir", default="runs")
    ap.add_argument("--name", default="pipeline_vs_conventional", help="bench/results/<name>.json|png")
    ap.add_argument(
        "--analyze-only", action="store_true", help="re-analyse the runs of the last results file"
    )
    args = ap.parse_args()
    out_json, out_png = RESULTS / f"{args.name}.json", RESULTS / f"{args.name}.png"
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := [m for m in modes if m not in MODES]:
        ap.error(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    if args.analyze_only:
        previous = json.loads(out_json.read_text())
        runs = []
        for old in previous["runs"]:
            kept = ("mode", "repeat", "run", "rc", "launch_s", "command", "stopped_at_target_version")
            keep = {k: old[k] for k in old if k in kept or k.startswith("completion_")}  # read after the run
            runs.append({**keep, **analyze_run(Path(args.runs_dir) / old["run"], args.target, args.window)})
        result = {**previous, "target": args.target, "window": args.window, "runs": runs}
    else:
        load_config(args.config, args.overrides)  # fail fast on a bad config or override
        epochs = epochs_needed(args.config, args.overrides, args.max_steps)
        stamp = time.strftime("%m%d-%H%M%S")
        load_before = machine_load()
        print(f"load before: {load_before}", flush=True)
        runs = []
        for repeat in range(1, args.repeats + 1):
            shift = (repeat - 1) % len(modes)
            order = modes[shift:] + modes[:shift]
            runs += [run_one(args, mode, repeat, stamp, epochs) for mode in order]
        load_after = machine_load()
        print(f"load after: {load_after}", flush=True)
        result = {
            "command": shlex.join([Path(sys.executable).name, *sys.argv]),
            "config": args.config,
            "overrides": args.overrides,
            "max_steps": args.max_steps,
            "target": args.target,
            "window": args.window,
            "loader_epochs": epochs,
            "pin_trainer_cpu": args.pin_trainer_cpu,
            "load": {"before": load_before, "after": load_after},
            "runs": runs,
        }
    result.update(aggregate(result["runs"], args.target))
    print_tables(result["runs"], result)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(result, indent=2))
    out_md = out_json.with_suffix(".md")
    out_md.write_text(markdown(result))
    plot(result["runs"], args.target, args.window, out_png)
    out_occupancy = out_png.with_name(f"{args.name}_occupancy.png")
    plot_occupancy(result["runs"], out_occupancy)
    print(f"\nwrote {out_json}, {out_md}, {out_png} and {out_occupancy}")
    return 0 if all(r.get("rc") == 0 for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
