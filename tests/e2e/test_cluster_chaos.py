"""A replicated cluster losing brokers during a run: three local KRaft nodes (`LocalCluster`, as
`stream-rl kafka up --brokers 3`), every topic at replication 3 / min ISR 2, one short run through
the launcher (`launcher.restart: true`) during which the broker leading `training-batches` and
then the one leading `scored` (partition 0) are SIGKILLed and each restarted after the run made two
more versions without it (the seconds from each kill to the next version are printed: failover).
The run must finish, and the outside view (`chaos_checks.py`, the topics decoded with the .avsc
files alone) counts from the topics: nothing lost, nothing trained twice, groups whole, versions
0..N gapless, every trained sample within the lag bound but for the failover's overtaking, and
every sample beyond it reported by the trainer."""

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
from chaos_checks import (
    collect,
    none_trained_twice,
    nothing_lost,
    over_the_bound_only_as_reported,
    versions_gapless,
)
from confluent_kafka.admin import AdminClient
from outside import Decoder, VersionWatch, topic

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
RUN = f"cluster{os.getpid()}"
GROUP, STEP, MAX_STEPS, MAX_LAG = 4, 16, 14, 1
PLAN = [(2, "training-batches"), (6, "scored")]
"""(version reached, topic): SIGKILL the broker leading the topic's partition 0; it is restarted
once the run has made RESTART_AFTER more versions without it."""
RESTART_AFTER = 2


def _leader(admin: AdminClient, name: str) -> int:
    return int(admin.list_topics(topic=name, timeout=10).topics[name].partitions[0].leader)


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from stream_rl.common.ports import free_port
    from stream_rl.inference.model_maker import make_model
    from stream_rl.kafka.cluster import LocalCluster

    tmp = tmp_path_factory.mktemp("cluster-chaos")
    model = make_model(tmp / "tiny", "tiny", seed=0)
    cluster = LocalCluster(tmp / "kafka", brokers=3, ports=[free_port() for _ in range(3)])
    bootstrap = cluster.up(quiet=True)
    cfg = {
        "run": RUN,
        "runs_dir": str(tmp / "runs"),
        "model": {"path": str(model)},
        "kafka": {"bootstrap": bootstrap, "partitions": 2, "replication_factor": 3, "min_insync_replicas": 2},
        "task": {"name": "arithmetic", "params": {"num_problems": 24}},
        "loader": {"epochs": 20},
        "actor": {"group_size": GROUP, "max_lag": MAX_LAG, "sampling": {"max_tokens": 4}},
        "inference": {"num_servers": 1, "base_port": free_port(), "max_batch": 32},
        "trainer": {"samples_per_step": STEP, "max_steps": MAX_STEPS, "bucket_mb": 1, "checkpoint_every": 2},
        "launcher": {"restart": True, "max_restarts": 6, "max_wall_s": 500, "stall_timeout_s": 90},
    }
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = open(tmp / "launcher.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "stream_rl.cli", "run", str(path)],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    decoder = Decoder()
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    watch = VersionWatch(bootstrap, RUN, decoder)
    done: list[str] = []
    stalls: list[float] = []
    down: tuple[Any, int, float] | None = None  # (node, version at the kill, when)
    stalled = False  # a kill whose next version has not come yet
    try:
        deadline = time.monotonic() + 520
        plan = list(PLAN)
        while proc.poll() is None and time.monotonic() < deadline:
            version = watch.poll()
            if down is not None:
                node, at, when = down
                if version > at and stalled:
                    stalls.append(round(time.monotonic() - when, 1))
                    stalled = False
                if version >= at + RESTART_AFTER:
                    # Not waiting for it to answer: versions go on meanwhile (a blocking restart
                    # once let the run reach its end before the second kill).
                    node.up(quiet=True, wait=False)  # it rejoins the running quorum and catches up
                    done.append(f"restarted {node.data_dir.name}@{version}")
                    down = None
            elif plan and version >= plan[0][0]:
                _at, name = plan.pop(0)
                leader = _leader(admin, topic(RUN, name))
                node = cluster.node(leader - 1)
                st = node.running()
                assert st is not None, f"node {leader} leads {name} but does not run"
                os.kill(st.pid, signal.SIGKILL)
                down, stalled = (node, version, time.monotonic()), True
                done.append(f"killed the leader of {name} (node {leader})@{version}")
        if proc.poll() is None:
            proc.kill()
        proc.wait(60)
        out = (tmp / "launcher.log").read_text(errors="replace")
        data = collect(bootstrap, RUN, decoder)
    finally:
        watch.close()
        log.close()
        if proc.poll() is None:
            proc.kill()
        cluster.down(quiet=True)
    data.update({"rc": proc.returncode, "log": out, "done": done, "stalls": stalls})
    print(json.dumps({"done": done, "seconds from a kill to the next version": stalls}))
    return data


def test_the_run_finished_through_two_leader_kills(cluster_run: dict[str, Any]) -> None:
    assert cluster_run["rc"] == 0, cluster_run["log"][-4000:]
    assert len(cluster_run["done"]) == 2 * len(PLAN), (cluster_run["done"], cluster_run["log"][-3000:])
    versions_gapless(cluster_run, MAX_STEPS)


def test_nothing_lost_on_the_cluster(cluster_run: dict[str, Any]) -> None:
    nothing_lost(cluster_run, GROUP)


def test_nothing_trained_twice_on_the_cluster(cluster_run: dict[str, Any]) -> None:
    none_trained_twice(cluster_run, GROUP, at_least=MAX_STEPS * STEP)


def test_the_lag_bound_holds_but_for_the_failover_and_is_reported(cluster_run: dict[str, Any]) -> None:
    """A clean-clone run saw one group of 4 (of 256 samples) trained at lag 3 with max_lag 1: the
    scored partition whose leader was killed fell behind the other one."""
    over_the_bound_only_as_reported(cluster_run, MAX_LAG, at_most=0.05)
