"""`launcher.autoscale` in a launcher run (docs/autoscaling.md): one launched server, at most two.
The thresholds are set so that the policy's two server rules fire on this tiny CPU run: the fleet
grows (the trainer starving and the servers busy) once versions come, and shrinks when the
problems run out (the servers idle). The test waits for both decisions in the run's timeline, then
stops the launcher (SIGINT).

Checked from the outside: the launcher's log and timeline record both decisions with the signal that
moved them, applied (no error); `runs/<run>/autoscale.json` and the plot panel show them; the added
server joined, served rollouts and left through the `servers` topic (joined, draining, left); and
nothing was lost or trained twice (`chaos_checks.py`, the topics decoded with the .avsc files)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from chaos_checks import collect, none_trained_twice, nothing_lost, versions_gapless
from outside import Decoder, read_topic, topic

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
RUN = f"autoscale{os.getpid()}"
GROUP, STEP, PROBLEMS = 4, 16, 96


def decisions(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [r for r in (json.loads(x) for x in lines if x.strip()) if r.get("kind") == "autoscale"]


@pytest.fixture(scope="module")
def scaled(tmp_path_factory: pytest.TempPathFactory, kafka_bootstrap: str) -> dict[str, Any]:
    from stream_rl.common.ports import free_port
    from stream_rl.inference.model_maker import make_model

    tmp = tmp_path_factory.mktemp("autoscale")
    model = make_model(tmp / "tiny", "tiny", seed=0)
    base = free_port()
    cfg = {
        "run": RUN,
        "runs_dir": str(tmp / "runs"),
        "model": {"path": str(model)},
        "kafka": {"bootstrap": kafka_bootstrap, "partitions": 2},
        "task": {"name": "arithmetic", "params": {"num_problems": PROBLEMS}},
        "actor": {"group_size": GROUP, "max_lag": 2, "sampling": {"max_tokens": 8}},
        "inference": {"num_servers": 1, "base_port": base, "max_batch": 32},
        "trainer": {"samples_per_step": STEP, "max_steps": 2000, "bucket_mb": 1},
        "launcher": {
            "max_wall_s": 150,
            "stall_timeout_s": None,  # the run idles once the problems are out
            "autoscale": {
                "enabled": True,
                "cooldown_s": 5,
                "sustain": 1,
                "servers": {"min": 1, "max": 2},
                # Any running sequence is demand for one more server while the trainer starves (its
                # busy fraction is 0.02-0.1 here: it waits for generation); the lag bound never
                # holds. This run is about the mechanics, not the tuning.
                "thresholds": {"occupancy_high": 0.01, "occupancy_low": 0.0, "lag_bound_frac": 100},
            },
        },
    }
    path = tmp / "autoscale.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_dir = tmp / "runs" / RUN
    log = tmp / "launcher.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stream_rl.cli", "run", str(path)], cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 170
            while proc.poll() is None and time.monotonic() < deadline:
                made = [d for d in decisions(run_dir / "timeline.jsonl") if d["role"] == "server"]
                if any(d["after"] < d["before"] for d in made):
                    proc.send_signal(signal.SIGINT)
                    break
                time.sleep(0.5)
            rc = proc.wait(90)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    wall = time.monotonic() - started
    decoder = Decoder()
    data = collect(kafka_bootstrap, RUN, decoder)
    data["servers"] = [
        decoder.decode(v)[1] for _p, _o, v in read_topic(kafka_bootstrap, topic(RUN, "servers")) if v
    ]
    data.update(
        {
            "rc": rc,
            "log": log.read_text(errors="replace"),
            "run_dir": run_dir,
            "scaled_url": f"http://127.0.0.1:{base + 1}",
            "decisions": decisions(run_dir / "timeline.jsonl"),
        }
    )
    print(
        json.dumps(
            {"wall_s": round(wall, 1), "decisions": [d["reason"] for d in data["decisions"]]}, indent=1
        )
    )
    return data


def test_the_policy_added_then_removed_a_server(scaled: dict[str, Any]) -> None:
    assert scaled["rc"] == 0, scaled["log"][-3000:]
    made = [(d["role"], d["before"], d["after"], d["signal"], d["error"]) for d in scaled["decisions"]]
    assert made[:2] == [
        ("server", 1, 2, "server occupancy", None),
        ("server", 2, 1, "server occupancy", None),
    ], made
    up, down = scaled["decisions"][:2]
    assert down["t"] - up["t"] >= 5  # the cool-down
    assert (
        "while the trainer starves" in up["reason"]
        and "< 0.7)" in up["reason"]
        and "fits 1" in down["reason"]
    )
    log = scaled["log"]
    assert "autoscale: on (server 1-2; cool-down 5 s)" in log
    assert f"autoscale: server 1 -> 2: {up['reason']}" in log
    assert f"autoscale: started server-1 at {scaled['scaled_url']}: it holds the newest version" in log
    assert "autoscale: stopped server-1" in log, log[-3000:]


def test_the_decisions_are_in_the_status_state_and_the_plots(scaled: dict[str, Any]) -> None:
    from stream_rl.observe.autoscaling import read_state, status_lines
    from stream_rl.observe.plots import autoscale_panel
    from stream_rl.observe.report import load_timeline

    run_dir = scaled["run_dir"]
    state = read_state(run_dir)
    assert state is not None and state["replicas"]["server"] == 1
    text = "\n".join(status_lines(state))
    assert "server 1 -> 2 [server occupancy]" in text and "server 2 -> 1 [server occupancy]" in text, text
    panel = autoscale_panel(load_timeline(run_dir / "timeline.jsonl"))
    assert panel is not None
    labels = {line.label for line in panel.lines}
    assert {"server", "server +1: server occupancy", "server -1: server occupancy"} <= labels, labels
    assert (run_dir / "plots" / "autoscale.png").stat().st_size > 5000


def test_the_added_server_joined_served_and_left(scaled: dict[str, Any]) -> None:
    url = scaled["scaled_url"]
    states = [m["state"] for m in scaled["servers"] if m["url"] == url]
    assert states == ["joined", "draining", "left"], states
    served = [r for _p, _o, r in scaled["raw-rollouts"] if r["server_id"] == url]
    assert served, f"{url} was never routed to"


def test_nothing_lost_or_trained_twice_across_the_changes(scaled: dict[str, Any]) -> None:
    last = max(wv["version"] for wv in scaled["weight-versions"])
    versions_gapless(scaled, last)
    nothing_lost(scaled, GROUP)
    none_trained_twice(scaled, GROUP, at_least=last * STEP)
