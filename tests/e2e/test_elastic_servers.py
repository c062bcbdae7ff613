"""Inference servers joining and leaving a run that goes on (README "Scaling during a run",
docs/servers-protocol.md), as a user does it: one launcher run with one launched server; at
version JOIN_AT a second built-in server is started by hand and announced with `stream-rl servers
join`, which returns once the server holds the newest version; SERVED_FOR versions later it is
announced leaving with `stream-rl servers leave`, which returns once the server is drained, and then stopped
(SIGTERM). The outside view (`chaos_checks.py`, the topics decoded with the .avsc files alone)
checks that the new server was routed to only with the current weights (every token it sampled
was sampled by a version at least the newest one when it joined; it loaded version 0's weights),
that versions after the join list it as updated and versions after the leave do not, and that
nothing was lost or trained twice."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import confluent_kafka as ck
import pytest
import yaml
from chaos_checks import collect, none_trained_twice, nothing_lost, versions_gapless, within_lag_bound
from outside import Decoder, read_topic, topic

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
RUN = f"elastic{os.getpid()}"
GROUP, STEP, MAX_STEPS, MAX_LAG = 4, 16, 40, 1
JOIN_AT, SERVED_FOR = 2, 4
"""The second server is started at version JOIN_AT; it leaves SERVED_FOR versions after it holds the
newest one (a server starts in seconds; the run makes about three versions a second here)."""
TOKEN = "elastic-admin-token"
CLI = [sys.executable, "-m", "stream_rl.cli"]


@pytest.fixture(scope="module")
def elastic(tmp_path_factory: pytest.TempPathFactory, kafka_bootstrap: str) -> dict[str, Any]:
    from stream_rl.inference.model_maker import make_model
    from stream_rl.kafka.broker import free_port

    tmp = tmp_path_factory.mktemp("elastic")
    model = make_model(tmp / "tiny", "tiny", seed=0)
    cfg = {
        "run": RUN,
        "runs_dir": str(tmp / "runs"),
        "model": {"path": str(model)},
        "kafka": {"bootstrap": kafka_bootstrap, "partitions": 2},
        "task": {"name": "arithmetic", "params": {"num_problems": 24}},
        "loader": {"epochs": 20},
        "actor": {"group_size": GROUP, "max_lag": MAX_LAG, "sampling": {"max_tokens": 4}},
        "inference": {"num_servers": 1, "base_port": free_port(), "max_batch": 32, "admin_token": TOKEN},
        "trainer": {"samples_per_step": STEP, "max_steps": MAX_STEPS, "bucket_mb": 1},
        "launcher": {"max_wall_s": 400, "stall_timeout_s": 90},
    }
    path = tmp / "elastic.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    logs = {name: open(tmp / f"{name}.log", "w") for name in ("launcher", "server", "join", "leave")}  # noqa: SIM115
    run = subprocess.Popen(
        [*CLI, "run", str(path)], cwd=REPO, stdout=logs["launcher"], stderr=subprocess.STDOUT, env=env
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server: subprocess.Popen[bytes] | None = None
    join: subprocess.Popen[bytes] | None = None
    leave: subprocess.Popen[bytes] | None = None
    decoder = Decoder()
    reader = ck.Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": "elastic-watch", "log_level": 0})
    seen: set[int] = set()
    marks: dict[str, Any] = {}
    try:
        deadline = time.monotonic() + 420
        assigned = False
        while run.poll() is None and time.monotonic() < deadline:
            if not assigned:
                try:
                    reader.assign([ck.TopicPartition(topic(RUN, "weight-versions"), 0, 0)])
                    assigned = True
                except ck.KafkaException:
                    time.sleep(1)
                    continue
            for m in reader.consume(100, 0.5):
                if m.error() is None and m.value():
                    seen.add(decoder.decode(m.value())[1]["version"])
            version = max(seen, default=-1)
            if server is None and version >= JOIN_AT:
                server = subprocess.Popen(
                    [*CLI, "serve", "--model", str(model), "--port", str(port), "--max-batch", "32", "--seed", "77"],
                    cwd=REPO, stdout=logs["server"], stderr=subprocess.STDOUT, env={**env, "STREAM_RL_ADMIN_TOKEN": TOKEN},
                    start_new_session=True,
                )  # fmt: skip
                join = subprocess.Popen(
                    [*CLI, "servers", "join", "--config", str(path), "--url", url, "--timeout-s", "120"],
                    cwd=REPO, stdout=logs["join"], stderr=subprocess.STDOUT, env=env,
                )  # fmt: skip
                marks["version_at_join"] = version
            if join is not None and "join_rc" not in marks and join.poll() is not None:
                marks["join_rc"] = join.returncode
                marks["version_when_current"] = max(seen)
                listing = subprocess.run(
                    [*CLI, "servers", "list", "--config", str(path)], cwd=REPO, capture_output=True, text=True
                )
                marks["listing"] = listing.stdout + listing.stderr
            if leave is None and "join_rc" in marks and version >= marks["version_when_current"] + SERVED_FOR:
                leave = subprocess.Popen(
                    [*CLI, "servers", "leave", "--config", str(path), "--url", url, "--timeout-s", "60"],
                    cwd=REPO, stdout=logs["leave"], stderr=subprocess.STDOUT, env=env,
                )  # fmt: skip
                marks["version_at_leave"] = version
            if leave is not None and "leave_rc" not in marks and leave.poll() is not None:
                marks["leave_rc"] = leave.returncode
                marks["version_when_left"] = max(seen)
                assert server is not None
                os.killpg(server.pid, signal.SIGTERM)
                marks["server_rc"] = server.wait(30)
        if run.poll() is None:
            run.kill()
        run.wait(60)
        data = collect(kafka_bootstrap, RUN, decoder)
        data["servers"] = [
            decoder.decode(v)[1] for _p, _o, v in read_topic(kafka_bootstrap, topic(RUN, "servers")) if v
        ]
    finally:
        reader.close()
        for proc in (run, server, join, leave):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(30)
        for f in logs.values():
            f.close()
    out = {name: (tmp / f"{name}.log").read_text(errors="replace") for name in logs}
    trainer_log = (tmp / "runs" / RUN / "trainer" / "stdout.log").read_text(errors="replace")
    data.update({"rc": run.returncode, "logs": out, "trainer_log": trainer_log, "url": url, **marks})
    pushed = re.findall(r"version \d+ pushed to joining server.*", trainer_log)
    figures = {
        "join": out["join"].strip().splitlines()[-2:],
        "trainer": pushed,
        "leave": out["leave"].strip().splitlines()[-1:],
        **{k: v for k, v in marks.items() if k.startswith("version")},
    }
    print(json.dumps(figures))
    return data


def test_the_run_finishes_with_a_server_joining_and_leaving(elastic: dict[str, Any]) -> None:
    assert elastic["rc"] == 0, elastic["logs"]["launcher"][-3000:]
    assert elastic.get("join_rc") == 0, elastic["logs"]["join"][-2000:]
    assert elastic.get("leave_rc") == 0, elastic["logs"]["leave"][-2000:]
    assert elastic.get("server_rc") == 0, elastic["logs"]["server"][-2000:]
    versions_gapless(elastic, MAX_STEPS)
    assert re.search(r"holds version \d+, the newest", elastic["logs"]["join"]), elastic["logs"]["join"]
    assert "drained in" in elastic["logs"]["leave"], elastic["logs"]["leave"]
    # `servers list` while it served: the launched server from the config, the joined one from the topic.
    rows = [line.split() for line in elastic["listing"].splitlines()]
    assert [elastic["url"], "builtin", "joined"] in [r[:3] for r in rows], elastic["listing"]
    assert any(r[2:3] == ["configured"] for r in rows), elastic["listing"]
    states = [m["state"] for m in elastic["servers"] if m["url"] == elastic["url"]]
    assert states == ["joined", "draining", "left"], states


def test_a_joining_server_gets_the_current_version_before_its_first_routed_request(
    elastic: dict[str, Any],
) -> None:
    url = elastic["url"]
    log = elastic["trainer_log"]
    assert re.search(rf"version (\d+) pushed to joining server\(s\) {re.escape(url)}", log), log[-3000:]
    mine = [r for _p, _o, r in elastic["raw-rollouts"] if r["server_id"] == url]
    assert mine, "the joined server was never routed to"
    sampled_by = {span["version"] for r in mine for span in r["version_spans"]}
    # It loaded the model's weights (version 0); the actor routed to it only once it held the
    # newest version, which was at least the one published when it joined.
    joined = next(m for m in elastic["servers"] if m["url"] == url and m["state"] == "joined")
    newest_at_join = max(
        wv["version"] for wv in elastic["weight-versions"] if wv["created_ms"] <= joined["created_ms"]
    )
    assert min(sampled_by) >= newest_at_join >= JOIN_AT, (sorted(sampled_by), newest_at_join)
    updated = {wv["version"]: url in wv["servers_updated"] for wv in elastic["weight-versions"]}
    after_join = [v for v in updated if elastic["version_when_current"] < v <= elastic["version_at_leave"]]
    assert after_join and all(updated[v] for v in after_join), updated
    after_leave = [v for v in updated if v > elastic["version_when_left"]]
    assert after_leave and not any(updated[v] for v in after_leave), updated


def test_nothing_lost_or_trained_twice_with_servers_joining_and_leaving(elastic: dict[str, Any]) -> None:
    nothing_lost(elastic, GROUP)
    none_trained_twice(elastic, GROUP, at_least=MAX_STEPS * STEP)
    within_lag_bound(elastic, MAX_LAG)
