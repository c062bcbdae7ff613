"""bench/run_probe.py: the figures of the pipeline-vs-conventional benchmark, from a synthetic
timeline and probe samples, and the /proc sampling on real processes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.unit

PROBE_PATH = Path(__file__).resolve().parents[2] / "bench" / "run_probe.py"


@pytest.fixture(scope="module")
def probe() -> ModuleType:
    spec = importlib.util.spec_from_file_location("run_probe", PROBE_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_roles_and_moving_mean(probe: ModuleType) -> None:
    assert [probe.role_of(n) for n in ("actor-0", "server-12", "trainer", "pre-x")] == [
        "actor",
        "server",
        "trainer",
        "pre-x",
    ]
    assert probe.centered_mean([0.0, 3.0, 6.0, 9.0], 3) == [1.5, 3.0, 6.0, 7.5]


def test_time_to_target_uses_the_centred_mean(probe: ModuleType) -> None:
    curve = [(1.0, 0.1), (2.0, 0.9), (3.0, 0.1), (4.0, 0.6), (5.0, 0.8), (6.0, 0.9)]
    # one lucky version (0.9 at t=2) does not count; the smoothed curve reaches 0.7 at t=5
    assert probe.time_to_target(curve, 0.7, 3) == 5.0
    assert probe.time_to_target(curve, 0.95, 3) is None


def test_interpolation_of_cumulative_series(probe: ModuleType) -> None:
    points = [(10.0, 0.0), (12.0, 4.0), (14.0, 4.0)]
    assert probe.interpolate(points, 11.0) == 2.0
    assert probe.interpolate(points, 5.0) == 0.0 and probe.interpolate(points, 99.0) == 4.0
    assert probe.delta(points, 11.0, 13.0) == 2.0
    assert probe.interpolate([], 1.0) is None


def synthetic_run() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Version 0 at t=100 s, then one version every 2 s with reward 0.1 v; the trainer computes
    0.5 s per step; the engine is busy 1.5 s of every 2; the actor writes 64 samples per step."""
    timeline: list[dict[str, Any]] = [{"t": 0.0, "kind": "start", "wall_time": 90.0}]
    samples = []
    for v in range(11):
        t = 100.0 + 2 * v
        record = {"kind": "version", "version": v, "created_ms": t * 1000, "samples_trained": 64 * v}
        if v:
            record |= {
                "reward_mean": 0.1 * v,
                "compute_s": 0.5,
                "broadcast_ms": 100.0,
                "step_s": 2.0,
                "version_lag_mean": 0.5,
                "version_lag_max": float(v % 3),
                "ess": 0.9 + 0.01 * v,
                "version_lag_n0": 32.0,
                "version_lag_n1": 24.0 if v % 3 == 2 else 32.0,
                "version_lag_last_mean": 0.25,
                "version_lag_last_max": 1.0,
            }
            if v % 3 == 2:
                record["version_lag_n2"] = 8.0
        timeline.append(record)
        timeline.append({"t": t - 90.0, "kind": "offsets", "offsets": {"actor": 64 * v}})
        samples.append(
            {
                "t": t,
                "cpu": {"trainer": 0.25 * v, "actor": 1.0 * v},
                "machine_s": 3.0 * v,
                "server": {
                    "busy_s": 1.5 * v,
                    "generated_tokens": 400.0 * v,
                    # 48 of 64 slots busy on average over the first half of the run, 64 after it
                    "sequence_s": 2 * 48.0 * v if v <= 5 else 2 * 48.0 * 5 + 2 * 64.0 * (v - 5),
                    "running": 48.0,
                    "max_batch": 64.0,
                },
            }
        )
    return timeline, samples


def test_analyze_figures_over_the_training_window(probe: ModuleType) -> None:
    timeline, samples = synthetic_run()
    r = probe.analyze(timeline, samples, target=0.5, window=3)
    assert r["versions"] == 10 and r["window_s"] == pytest.approx(20.0)
    # centred mean of (0.4, 0.5, 0.6) at version 5, published 10 s after version 0
    assert r["time_to_target_s"] == pytest.approx(10.0) and r["version_at_target"] == 5
    assert r["samples_at_target"] == 320
    assert r["final_reward"] == pytest.approx(0.9)
    assert r["trained_samples_per_s"] == pytest.approx(32.0)
    assert r["generated_samples_per_s"] == pytest.approx(32.0)
    assert r["trainer_busy"] == pytest.approx(0.25) and r["trainer_broadcast"] == pytest.approx(0.05)
    assert r["inference_idle"] == pytest.approx(0.25)
    assert r["generated_tokens_per_s"] == pytest.approx(200.0)
    assert r["version_lag_mean"] == 0.5 and r["version_lag_max"] == 2.0
    assert r["ess_min"] == pytest.approx(0.91) and r["ess_mean"] == pytest.approx(0.955)
    assert r["cpu_cores"] == {"actor": 0.5, "trainer": 0.125}
    assert r["cpu_s_per_step"] == {"actor": 1.0, "trainer": 0.25}
    assert r["samples_per_cpu_s"] == pytest.approx(640 / 12.5) and r["cpu_s_to_target"] == pytest.approx(6.25)
    assert r["machine_cores_busy"] == pytest.approx(1.5) and r["other_work_cores"] == pytest.approx(0.875)
    assert len(r["curve"]) == 10 and r["curve"][0] == {"t": 2.0, "version": 1, "samples": 64, "reward": 0.1}
    # occupancy: sequence-seconds over the window / (20 s x 64 slots), and per probe interval
    assert r["occupancy"] == pytest.approx((2 * 48 * 5 + 2 * 64 * 5) / 20 / 64)
    assert r["max_batch"] == 64.0
    series = r["occupancy_series"]
    assert [p["t"] for p in series] == [2.0 * i for i in range(1, 11)]
    assert [p["occupancy"] for p in series] == [0.75] * 5 + [1.0] * 5
    # lag distribution: summed counts of the ten versions (64 samples each)
    # per version 32 samples at lag 0, 32 at lag 1 except 8 of them at lag 2 when v % 3 == 2
    assert r["lag_counts"] == {"0": 320, "1": 296, "2": 24}
    assert sum(r["lag_counts"].values()) == 640
    assert (r["lag_p50"], r["lag_p90"], r["lag_p99"]) == (0, 1, 2)
    assert r["version_lag_last_mean"] == 0.25 and r["version_lag_last_max"] == 1.0


def test_analyze_without_updates_says_so(probe: ModuleType) -> None:
    timeline, _ = synthetic_run()
    assert "error" in probe.analyze(timeline[:2], [], target=0.5, window=3)


def test_probe_attributes_cpu_to_the_launchers_children(probe: ModuleType, tmp_path: Path) -> None:
    """A child listed in processes.json and the grandchild it starts both count for its role."""
    burn = "import time; t = time.process_time(); exec('while time.process_time() - t < 0.3: pass')"
    code = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}]); {burn}"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        (tmp_path / "processes.json").write_text(json.dumps({"pids": {"trainer": child.pid}, "servers": []}))
        p = probe.RunProbe(tmp_path, launcher_pid=os.getpid(), broker_dir=tmp_path / "no-broker")
        while child.poll() is None:
            p.sample()
            time.sleep(0.05)
    finally:
        child.wait()
    # the child exited: its last figure is kept; parent + grandchild burnt ~0.6 s of CPU
    assert p.samples[-1]["cpu"]["trainer"] >= 0.4
    assert p.samples[-1]["machine_s"] > p.samples[0]["machine_s"]


@pytest.fixture(scope="module")
def pvc() -> ModuleType:
    """bench/pipeline_vs_conventional.py (it imports its neighbours: bench/ on the path)."""
    sys.path.insert(0, str(PROBE_PATH.parent))
    try:
        spec = importlib.util.spec_from_file_location(
            "pvc", PROBE_PATH.parent / "pipeline_vs_conventional.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(PROBE_PATH.parent))
    return module


def test_comparison_ratios_and_markdown(probe: ModuleType, pvc: ModuleType) -> None:
    """`bench/pipeline_vs_conventional.py` turns analysed runs into medians, ratios and a table."""
    timeline, samples = synthetic_run()
    base = probe.analyze(timeline, samples, target=0.5, window=3)
    runs = [
        {**base, "mode": "conventional", "repeat": 1, "time_to_target_s": 20.0, "version_lag_max": 0},
        {**base, "mode": "pipeline", "repeat": 1, "time_to_target_s": 10.0, "occupancy": 0.8},
        {**base, "mode": "pipeline", "repeat": 2, "time_to_target_s": 12.0, "version_lag_max": 3.0},
        {**base, "mode": "pipeline-no-inflight", "repeat": 1, "time_to_target_s": 16.0},
    ]
    agg = pvc.aggregate(runs, target=0.5)
    pipe = agg["modes"]["pipeline"]
    assert pipe["time_to_target_s"] == pytest.approx(11.0) and pipe["range"]["time_to_target_s"] == [
        10.0,
        12.0,
    ]
    assert agg["ratios"]["time_to_target_pipeline_over_conventional"] == pytest.approx(11 / 20)
    assert agg["ratios"]["time_to_target_pipeline_over_no_inflight"] == pytest.approx(11 / 16)
    assert pipe["lag_counts"] == {"0": 640, "1": 592, "2": 48}  # both pipeline runs
    goal = agg["goal"]
    assert goal["time_ok"] and goal["inflight_ok"] and goal["samples_ok"]  # 0.55, 0.69, 1.0
    assert not goal["max_lag_ok"]  # a lag of 3 > 2
    assert pipe["occupancy"] == pytest.approx((0.8 + base["occupancy"]) / 2)
    assert goal["broker_share"] is None and not goal["broker_ok"]  # no broker among the processes
    runs[1]["broker_share"], runs[2]["broker_share"] = 0.04, 0.08
    assert pvc.aggregate(runs, target=0.5)["goal"]["broker_share"] == pytest.approx(0.06)
    assert not pvc.aggregate(runs, target=0.5)["goal"]["broker_ok"]  # the median 0.06 > 0.05
    table = pvc.markdown(agg)
    assert "| pipeline | 2 | 11.0 (10.0–12.0) |" in table and "**0.55×**" in table and "**0.69×**" in table
    assert "pipeline-recompute" not in table.split("\n\n")[0]  # only the modes that ran


def test_stop_at_target_waits_for_the_centred_mean_to_be_final(pvc: ModuleType, tmp_path: Path) -> None:
    """`--stop-at-target` stops a run only once the centred mean at the target's version has its
    whole window published; a half-written last line of the live timeline is skipped."""
    path = tmp_path / "timeline.jsonl"
    rewards = [0.0, 0.1, 0.2, 0.4, 0.5, 0.6, 0.9]  # version 0 (init) has no reward of its own

    def write(n: int, tail: str = "") -> None:
        lines = [json.dumps({"kind": "start"})]
        lines += [
            json.dumps({"kind": "version", "version": v, "created_ms": 1000 * v, "reward_mean": rewards[v]})
            for v in range(n)
        ]
        path.write_text("\n".join(lines) + "\n" + tail)

    write(5)  # versions 1-4 (0.1, 0.2, 0.4, 0.5): version 4's centred mean waits for version 5
    assert pvc.target_reached(tmp_path, 0.5, 3) is None
    write(6, tail='{"kind": "version", "vers')  # version 5 (0.6) in, the next line half written
    assert pvc.target_reached(tmp_path, 0.5, 3) == 4  # (0.4 + 0.5 + 0.6) / 3, now final
    assert pvc.target_reached(tmp_path, 0.55, 3) is None  # version 5's mean is not final yet
    write(7)  # version 6 (0.9): version 5's (0.5 + 0.6 + 0.9) / 3 is final
    assert pvc.target_reached(tmp_path, 0.55, 3) == 5
    assert pvc.target_reached(tmp_path, 0.95, 3) is None
