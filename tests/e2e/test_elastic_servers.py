"""Servers and consumers added to and removed from a run that goes on (docs/operations.md "Scaling during a
run", docs/servers-protocol.md), as a user does it, in one launcher run (one launched server, two
actors, one verifier) that the test stops once everything below happened:

1. at version JOIN_AT, at once: a built-in server started by hand and announced with `stream-rl
   servers join` (which returns once it holds the newest version), and `stream-rl scale actor=1
   verifier=2 server=2` (the launcher stops actor-1, starts verifier-1 and server-1, and joins
   server-1 the same way);
2. SERVED_FOR versions after both hold the newest version: `stream-rl servers leave` for the hand
   server (then SIGTERM) and `stream-rl scale server=1` (the launcher drains and stops server-1);
3. three versions later the launcher is stopped (SIGINT).

The outside view (`chaos_checks.py`, the topics decoded with the .avsc files alone) checks that
each joined server was routed to only with the current weights (every token it sampled came from
a version at least the newest one when its `joined` record was written; it loaded version 0's),
that versions list it as updated while it is a member and not after it left, that the added
verifier scored, that nothing was lost or trained twice, and that every trained sample is within
the lag bound (two actors, then one, sharing it by partition)."""

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

import pytest
import yaml
from chaos_checks import collect, none_trained_twice, nothing_lost, versions_gapless, within_lag_bound
from outside import Decoder, VersionWatch, read_topic, topic

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
RUN = f"elastic{os.getpid()}"
GROUP, STEP, MAX_LAG = 4, 16, 1
JOIN_AT, SERVED_FOR, AFTER = 2, 4, 3
TOKEN = "elastic-admin-token"
CLI = [sys.executable, "-m", "stream_rl.cli"]


class Steps:
    """The commands the test runs during the run, each a process whose output is kept."""

    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        self.tmp, self.env = tmp, env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.files: dict[str, Any] = {}

    def start(self, name: str, *args: str, **kw: Any) -> None:
        self.files[name] = open(self.tmp / f"{name}.log", "w")  # noqa: SIM115 - closed in close()
        self.procs[name] = subprocess.Popen(
            [*CLI, *args], cwd=REPO, stdout=self.files[name], stderr=subprocess.STDOUT, env=self.env, **kw
        )

    def done(self, *names: str) -> bool:
        return all(n in self.procs and self.procs[n].poll() is not None for n in names)

    def rc(self, name: str) -> int | None:
        return self.procs[name].returncode if name in self.procs else None

    def out(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        for f in self.files.values():
            f.close()


@pytest.fixture(scope="module")
def elastic(tmp_path_factory: pytest.TempPathFactory, kafka_bootstrap: str) -> dict[str, Any]:
    from stream_rl.common.ports import free_port
    from stream_rl.inference.model_maker import make_model

    tmp = tmp_path_factory.mktemp("elastic")
    model = make_model(tmp / "tiny", "tiny", seed=0)
    base = free_port()
    cfg = {
        "run": RUN,
        "runs_dir": str(tmp / "runs"),
        "model": {"path": str(model)},
        "kafka": {"bootstrap": kafka_bootstrap, "partitions": 2},
        "task": {"name": "arithmetic", "params": {"num_problems": 24}},
        "loader": {"epochs": 100},
        "actor": {"group_size": GROUP, "max_lag": MAX_LAG, "sampling": {"max_tokens": 4}},
        "inference": {"num_servers": 1, "base_port": base, "max_batch": 32, "admin_token": TOKEN},
        "trainer": {"samples_per_step": STEP, "max_steps": 2000, "bucket_mb": 1},
        "launcher": {"actors": 2, "max_wall_s": 420, "stall_timeout_s": 120},
    }
    path = tmp / "elastic.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    steps = Steps(tmp, env)
    port = free_port()
    url, scaled_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{base + 1}"
    runs = ["--run", RUN, "--runs-dir", str(tmp / "runs")]
    decoder = Decoder()
    watch = VersionWatch(kafka_bootstrap, RUN, decoder)
    marks: dict[str, Any] = {}
    steps.start("launcher", "run", str(path))
    run = steps.procs["launcher"]
    try:
        deadline = time.monotonic() + 440
        while run.poll() is None and time.monotonic() < deadline:
            version = watch.poll()
            if "server" not in steps.procs and version >= JOIN_AT:
                marks["version_at_join"] = version
                server_env = {**env, "STREAM_RL_ADMIN_TOKEN": TOKEN}
                steps.env = server_env
                steps.start("server", "serve", "--model", str(model), "--port", str(port), "--seed", "77", start_new_session=True)  # fmt: skip
                steps.env = env
                steps.start(
                    "join", "servers", "join", "--config", str(path), "--url", url, "--timeout-s", "180"
                )
                steps.start("scale_up", "scale", *runs, "actor=1", "verifier=2", "server=2")
            if "current" not in marks and steps.done("join", "scale_up"):
                marks["current"] = watch.newest
                listing = subprocess.run(
                    [*CLI, "servers", "list", "--config", str(path)], cwd=REPO, capture_output=True, text=True
                )
                marks["listing"] = listing.stdout + listing.stderr
            if "leave" not in steps.procs and "current" in marks and version >= marks["current"] + SERVED_FOR:
                marks["version_at_leave"] = version
                steps.start(
                    "leave", "servers", "leave", "--config", str(path), "--url", url, "--timeout-s", "60"
                )
                steps.start("scale_down", "scale", *runs, "server=1")
            if "left" not in marks and steps.done("leave", "scale_down"):
                marks["left"] = watch.newest
                os.killpg(steps.procs["server"].pid, signal.SIGTERM)
                marks["server_rc"] = steps.procs["server"].wait(30)
            if "left" in marks and version >= marks["left"] + AFTER and "stopped" not in marks:
                marks["stopped"] = version
                run.send_signal(signal.SIGINT)
        if run.poll() is None:
            run.kill()
        run.wait(90)
        data = collect(kafka_bootstrap, RUN, decoder)
        data["servers"] = [
            decoder.decode(v)[1] for _p, _o, v in read_topic(kafka_bootstrap, topic(RUN, "servers")) if v
        ]
    finally:
        watch.close()
        steps.close()
    outs = {name: steps.out(name) for name in steps.procs}
    trainer_log = (tmp / "runs" / RUN / "trainer" / "stdout.log").read_text(errors="replace")
    rcs = {name: steps.rc(name) for name in steps.procs}
    data.update(
        {"rcs": rcs, "outs": outs, "trainer_log": trainer_log, "url": url, "scaled_url": scaled_url, **marks}
    )
    print(
        json.dumps(
            {
                "join": outs.get("join", "").strip().splitlines()[-2:],
                "scale up": outs.get("scale_up", "").strip().splitlines(),
                "trainer": re.findall(r"version \d+ pushed to joining server.*", trainer_log),
                "leave": outs.get("leave", "").strip().splitlines()[-1:],
                "scale down": outs.get("scale_down", "").strip().splitlines(),
                "versions": {k: v for k, v in marks.items() if k not in ("listing",)},
            },
            indent=1,
        )
    )
    return data


def test_the_commands_did_what_they_say(elastic: dict[str, Any]) -> None:
    rcs, outs = elastic["rcs"], elastic["outs"]
    assert "stopped" in elastic, (elastic["rcs"], outs.get("launcher", "")[-3000:])
    assert rcs == {"launcher": 0, "server": 0, "join": 0, "scale_up": 0, "leave": 0, "scale_down": 0}, {
        k: outs[k][-1500:] for k, rc in rcs.items() if rc != 0
    }
    assert elastic["server_rc"] == 0
    assert re.search(r"holds version \d+, the newest", outs["join"]), outs["join"]
    up = outs["scale_up"]
    assert "stopped actor-1 (exit 0)" in up and "started verifier-1" in up, up
    assert "actor-1: static member removed from its group" in up, up
    assert f"started server-1 at {elastic['scaled_url']}: it holds the newest version" in up, up
    assert "drained in" in outs["leave"] and "stopped server-1" in outs["scale_down"], outs
    versions = sorted({wv["version"] for wv in elastic["weight-versions"]})
    versions_gapless(elastic, versions[-1])
    # `servers list` while both served: the launched servers from the config... and the topic.
    rows = [line.split()[:3] for line in elastic["listing"].splitlines()]
    assert [elastic["url"], "builtin", "joined"] in rows and [
        elastic["scaled_url"],
        "builtin",
        "joined",
    ] in rows, elastic["listing"]
    for url in (elastic["url"], elastic["scaled_url"]):
        states = [m["state"] for m in elastic["servers"] if m["url"] == url]
        assert states == ["joined", "draining", "left"], (url, states)


@pytest.mark.parametrize("which", ["url", "scaled_url"], ids=["joined by hand", "added by scale"])
def test_a_joining_server_gets_the_current_version_before_its_first_routed_request(
    elastic: dict[str, Any], which: str
) -> None:
    url = elastic[which]
    log = elastic["trainer_log"]
    assert re.search(rf"version (\d+) pushed to joining server\(s\) [^\n]*{re.escape(url)}", log), log[-3000:]
    mine = [r for _p, _o, r in elastic["raw-rollouts"] if r["server_id"] == url]
    assert mine, f"{url} was never routed to"
    sampled_by = {span["version"] for r in mine for span in r["version_spans"]}
    joined = next(m for m in elastic["servers"] if m["url"] == url and m["state"] == "joined")
    newest_at_join = max(
        wv["version"] for wv in elastic["weight-versions"] if wv["created_ms"] <= joined["created_ms"]
    )
    # It loaded the model's weights (version 0); the actors routed to it only once it held the
    # newest version, at least the one published when it joined.
    assert min(sampled_by) >= newest_at_join >= JOIN_AT, (sorted(sampled_by), newest_at_join)
    updated = {wv["version"]: url in wv["servers_updated"] for wv in elastic["weight-versions"]}
    while_member = [v for v in updated if elastic["current"] < v <= elastic["version_at_leave"]]
    assert while_member and all(updated[v] for v in while_member), updated
    after = [v for v in updated if v > elastic["left"]]
    assert after and not any(updated[v] for v in after), updated


def test_a_stopped_actors_partitions_go_to_the_other_at_once(elastic: dict[str, Any]) -> None:
    """`scale actor=1` removes the stopped static member: actor-0 takes its partitions now, not when
    its session (120 s by default, longer than the rest of this run) expires."""
    rollouts = [r for _p, _o, r in elastic["raw-rollouts"]]
    gone = [r for r in rollouts if r["actor_id"] == "actor-1"]
    assert gone, "actor-1 never sampled"
    its = {r["problem_partition"] for r in gone}
    last = max(r["finished_ms"] for r in gone)
    taken = [
        r["started_ms"]
        for r in rollouts
        if r["actor_id"] == "actor-0" and r["problem_partition"] in its and r["started_ms"] > last
    ]
    assert taken, f"actor-0 never sampled actor-1's partitions {its} after it stopped"
    print(
        json.dumps(
            {
                "seconds from actor-1's last rollout to actor-0 sampling its partitions": round(
                    (min(taken) - last) / 1000, 1
                )
            }
        )
    )


def test_nothing_lost_or_trained_twice_while_servers_and_consumers_come_and_go(
    elastic: dict[str, Any],
) -> None:
    last = max(wv["version"] for wv in elastic["weight-versions"])
    nothing_lost(elastic, GROUP)
    none_trained_twice(elastic, GROUP, at_least=last * STEP)
    # Two actors, then one: they share the bound by the partitions of `problems` they hold.
    within_lag_bound(elastic, MAX_LAG)
    verifiers = {s["verifier_id"] for _p, _o, s in elastic["scored"]}
    assert verifiers == {"verifier-0", "verifier-1"}, verifiers
