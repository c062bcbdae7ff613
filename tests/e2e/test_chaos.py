"""Chaos: one short run through the launcher (`launcher.restart: true`) on its own broker, during
which every stage is SIGKILLed in turn (actor, verifier, preprocessor, trainer, inference
server: the server right after the trainer's last push, with the actor paused until nothing more
trains) and the broker is bounced three times (down, up). Then the outside view (`outside.py`:
the topics decoded with the .avsc files and fastavro alone) counts loss, duplicates, lag and
coverage. Before the outage handling, a bounce hung a run for good in 2 of 4 runs (a fenced
static consumer went silent) or crashed stages; three bounces in one run catch that.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from chaos_checks import (
    collect,
    none_trained_twice,
    nothing_lost,
    trained,
    versions_gapless,
    within_lag_bound,
)
from outside import Decoder, VersionWatch, read_topic, topic

from stream_rl.cli import STACKS_SIGNAL

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(720)]

REPO = Path(__file__).resolve().parents[2]
RUN = f"chaos{os.getpid()}"
GROUP = 4
PROBLEMS = 24
STEP = 16
MAX_STEPS = 14
MAX_LAG = 1
# (version reached, action): kills spread over the run, three bounces between them.
PLAN = [
    (2, "bounce"),
    (3, "actor-0"),
    (4, "verifier-0"),
    (5, "bounce"),
    # The server paused for longer than the trainer's update deadline (issue 36), while it holds
    # the newest version (before the drained kill, which leaves a restarted server stale until the
    # trainer re-pushes it): the push to it fails at its deadline and drops it, the actor sets it
    # aside as stale, the trainer joins it again after the pause and it is routed to again. (The
    # stall the issue found needs the stale server marked down too, by calls timing out while it is
    # paused; with the actor's window full while the trainer waits, none is in flight here: this
    # case passes with the routing before that fix too, which tests/unit/test_routing.py pins.)
    (6, "paused server-0"),
    (7, "preprocessor-0"),
    # The server right after the last push, the trainer alive (issue 15 item 2): the actor is
    # paused until no version comes (what was sampled is trained), then the server is killed and the
    # actor resumed. No push fails on the server, so only the trainer's idle version probe finds it
    # restarted (holding version 0) and re-pushes it; before, nothing did and the run waited for the
    # watchdog (the actor routes to no server older than the bound). A kill while samples are still
    # in flight would mostly be found by the next push failing, the path the other kills take.
    (8, "drained server-0"),
    (11, "bounce"),
    (12, "trainer"),
]
UPDATE_TIMEOUT_S = 6.0
"""trainer.update_timeout_s: a push to a server not installed within this drops the server."""
PAUSE_S = 3 * UPDATE_TIMEOUT_S
"""How long the paused server stays stopped: past the deadline of the push that meets it."""
QUIET_S = 10.0
"""After pausing the actor, no new version for this long: the trainer has pushed its last one (the
two steps in flight at `max_lag` 1 train within ~3 s here; on a machine loaded several times over a
step can take longer, then the kill falls before the last push, which fails and drops the server:
the path the other kills take)."""


def _drain_then_kill(pids: dict[str, int], watch: VersionWatch) -> int:
    """Pause actor-0 until no version comes for `QUIET_S` (at most 60 s), SIGKILL server-0, resume
    the actor; returns the last version pushed before the kill."""
    os.kill(pids["actor-0"], signal.SIGSTOP)
    try:
        last, quiet_since, limit = watch.newest, time.monotonic(), time.monotonic() + 60
        while time.monotonic() - quiet_since < QUIET_S and time.monotonic() < limit:
            version = watch.poll()
            if version != last:
                last, quiet_since = version, time.monotonic()
        os.kill(pids["server-0"], signal.SIGKILL)
    finally:
        os.kill(pids["actor-0"], signal.SIGCONT)
    return last


def _pending_samples(bootstrap: str, decoder: Decoder, consumed: dict[int, int]) -> int:
    """Samples in `training-batches` beyond the trainer's `consumed` offsets (committed records)."""
    records = read_topic(bootstrap, topic(RUN, "training-batches"))
    return sum(len(decoder.decode(v)[1]["samples"]) for p, o, v in records if v and o >= consumed.get(p, 0))


def _served_version(url: str) -> int:
    """The weight version a server holds (its `/health`)."""
    with urllib.request.urlopen(f"{url}/health", timeout=10) as resp:
        return int(json.loads(resp.read())["version"])


def _pause_server_under_a_push(
    pids: dict[str, int], watch: VersionWatch, bootstrap: str, decoder: Decoder, server_url: str
) -> int:
    """SIGSTOP server-0 just before the trainer pushes to it: the trainer is paused until a step's
    samples wait for it, then the server is stopped and the trainer resumed (it trains them and
    pushes to the stopped server, whose deadline drops it); `PAUSE_S` later the server resumes.
    The trainer is paused only once every version it pushed is read back: a push comes before the
    version's record, whose delivery a slow broker can hold for seconds (seen: the server held
    version 7 while `weight-versions` ended at 6, so the samples counted as waiting were 7's, and
    no push met the paused server). Returns the version the trainer held when paused."""
    deadline = time.monotonic() + 60
    while True:
        os.kill(pids["trainer"], signal.SIGSTOP)
        held, served = watch.poll(), _served_version(server_url)
        if served <= held:
            break
        os.kill(pids["trainer"], signal.SIGCONT)  # let it publish what it pushed, then again
        while watch.poll() < served:
            assert time.monotonic() < deadline, f"version {served} was pushed but never published"
    try:
        batches = topic(RUN, "training-batches")
        offsets = watch.versions[held]["consumed_offsets"]
        consumed = {o["partition"]: o["offset"] for o in offsets if o["topic"] == batches}
        while _pending_samples(bootstrap, decoder, consumed) < STEP:
            assert time.monotonic() < deadline, "no step's samples came for the paused trainer"
            time.sleep(0.5)
        os.kill(pids["server-0"], signal.SIGSTOP)
    finally:
        os.kill(pids["trainer"], signal.SIGCONT)
    try:
        resume = time.monotonic() + PAUSE_S
        while time.monotonic() < resume:
            watch.poll()
    finally:
        os.kill(pids["server-0"], signal.SIGCONT)
    return held


def _up(broker: Any) -> None:
    """Start the broker again; on a starved machine a restart can miss the 60 s readiness wait."""
    from stream_rl.errors import BrokerError

    for attempt in range(3):
        try:
            broker.up(quiet=True)
            return
        except BrokerError:
            if attempt == 2:
                raise


@pytest.fixture(scope="module")
def chaos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from stream_rl.common.ports import free_port
    from stream_rl.inference.model_maker import make_model
    from stream_rl.kafka.broker import LocalBroker

    tmp = tmp_path_factory.mktemp("chaos")
    model = make_model(tmp / "tiny", "tiny", seed=0)
    broker = LocalBroker(tmp / "kafka", port=free_port())
    bootstrap = broker.up(quiet=True).bootstrap
    cfg = {
        "run": RUN,
        "runs_dir": str(tmp / "runs"),
        "model": {"path": str(model)},
        "kafka": {"bootstrap": bootstrap, "partitions": 2},
        "task": {"name": "arithmetic", "params": {"num_problems": PROBLEMS}},
        "loader": {"epochs": 20},
        "actor": {"group_size": GROUP, "max_lag": MAX_LAG, "sampling": {"max_tokens": 4}},
        "inference": {"num_servers": 1, "base_port": free_port(), "max_batch": 32},
        "trainer": {
            "samples_per_step": STEP,
            "max_steps": MAX_STEPS,
            "bucket_mb": 1,
            "checkpoint_every": 2,
            "update_timeout_s": UPDATE_TIMEOUT_S,
        },
        # 6 restarts: a stage whose transactional producer wedges after a bounce (see README) is restarted.
        # max_wall_s: a hung run ends with its logs well within the module's 720 s (it takes
        # 110-260 s; the fixture's own bound below is for a launcher that hangs itself).
        "launcher": {"restart": True, "max_restarts": 6, "max_wall_s": 420, "stall_timeout_s": 90},
    }
    path = tmp / "chaos.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = open(tmp / "launcher.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "stream_rl.cli", "run", str(path)],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    decoder = Decoder()
    done: list[str] = []
    run_dir = tmp / "runs" / RUN
    watch = VersionWatch(bootstrap, RUN, decoder)
    try:
        deadline = time.monotonic() + 480
        plan = list(PLAN)
        while proc.poll() is None and time.monotonic() < deadline:
            version = watch.poll()
            if plan and version >= plan[0][0]:
                _at, action = plan.pop(0)
                processes = json.loads((run_dir / "processes.json").read_text())
                pids = processes["pids"]
                if action == "bounce":
                    broker.down(quiet=True)
                    time.sleep(1)
                    _up(broker)
                elif action == "drained server-0":
                    version = _drain_then_kill(pids, watch)
                elif action == "paused server-0":
                    version = _pause_server_under_a_push(
                        pids, watch, bootstrap, decoder, processes["servers"][0]
                    )
                else:
                    os.kill(pids[action], signal.SIGKILL)
                done.append(f"{action}@{version}")
        if proc.poll() is None:  # the launcher itself hung: its stacks into its log, then the kill
            proc.send_signal(STACKS_SIGNAL)
            time.sleep(2)
            proc.kill()
        proc.wait(60)
    finally:
        watch.close()
        log.close()
        if proc.poll() is None:
            proc.kill()
    out = (tmp / "launcher.log").read_text(errors="replace")
    try:
        data = collect(bootstrap, RUN, decoder)
    finally:
        broker.down(quiet=True)
    trainer_log = "".join(p.read_text(errors="replace") for p in sorted(run_dir.glob("trainer*/stdout.log")))
    actor_log = "".join(p.read_text(errors="replace") for p in sorted(run_dir.glob("actor-*/stdout.log")))
    data.update(
        {
            "rc": proc.returncode,
            "log": out,
            "done": done,
            "plan": PLAN,
            "stacks": _stacks(run_dir),
            "trainer_log": trainer_log,
            "actor_log": actor_log,
        }
    )
    return data


def _stacks(run_dir: Path) -> str:
    """The last stack dump in each stage log holding one (the launcher asks a stage it kills as
    stuck for one): where a stalled stage was blocked."""
    out = []
    for log in sorted(run_dir.glob("*/stdout.log")):
        lines = log.read_text(errors="replace").splitlines()
        # A dump's first thread header follows a line of the stage's own (its threads are
        # separated by blank lines and frames are indented).
        starts = [
            i
            for i, line in enumerate(lines)
            if line.endswith("(most recent call first):")
            and i
            and lines[i - 1].strip()
            and not lines[i - 1].startswith("  ")
        ]
        if starts:
            dump = "\n".join(lines[starts[-1] : starts[-1] + 120])
            out.append(f"\n--- {log.parent.name}: {len(starts)} stack dump(s), the last:\n{dump}")
    return "".join(out)


def test_the_run_finished_through_every_kill_and_bounce(chaos: dict[str, Any]) -> None:
    assert chaos["rc"] == 0, chaos["log"][-4000:] + chaos["stacks"]
    assert len(chaos["done"]) == len(PLAN), (chaos["done"], chaos["log"][-3000:])
    for child in ("actor-0", "verifier-0", "preprocessor-0", "trainer", "server-0"):
        assert f"restarting {child}" in chaos["log"], child
    versions_gapless(chaos, MAX_STEPS)


def test_the_paused_server_was_dropped_by_a_push_and_served_again(chaos: dict[str, Any]) -> None:
    """The pause did what it is for: a push met the stopped server and dropped it at its deadline;
    the run still finished (above), and the server held a version after it again."""
    dropped = [
        line
        for line in chaos["trainer_log"].splitlines()
        if "weight sync: dropping" in line and "(restarted)" not in line
    ]
    # The push's own deadline ("broadcast not received within the deadline (6.0 s)") or gloo's
    # timeout of the same length ("Timed out waiting 5990ms for send operation"), whichever first.
    assert any(" from version " in line for line in dropped), dropped
    assert "was not installed on it; waiting until it holds version" in chaos["actor_log"]  # set aside
    paused_at = next(int(d.rsplit("@", 1)[1]) for d in chaos["done"] if d.startswith("paused server-0@"))
    after = {span["version"] for _p, _o, r in chaos["raw-rollouts"] for span in r["version_spans"]}
    assert max(after) > paused_at + 1, (paused_at, sorted(after))  # sampled on newer weights since


def test_nothing_lost(chaos: dict[str, Any]) -> None:
    nothing_lost(chaos, GROUP)


def test_no_sample_trained_twice_and_groups_whole(chaos: dict[str, Any]) -> None:
    none_trained_twice(chaos, GROUP, at_least=MAX_STEPS * STEP)


def test_every_trained_sample_within_the_lag_bound(chaos: dict[str, Any]) -> None:
    within_lag_bound(chaos, MAX_LAG)


def test_epochs_stay_balanced(chaos: dict[str, Any]) -> None:
    """Problems are taken in plan order, epoch after epoch (issue 15 item 4: before, the actor
    drained one partition, all its epochs, first). Groups in flight together can finish out of
    order, so along the trained sequence the counts per problem differ by at most 2 (1 + that)."""
    order: list[str] = []
    for _v, s in trained(chaos):
        if s["group_id"] not in order:
            order.append(s["group_id"])
    assert len(order) >= PROBLEMS
    counts: Counter[str] = Counter()
    problems = {g.rsplit(".e", 1)[0] for g in order}
    assert len(problems) == PROBLEMS, "every problem was trained"
    for gid in order:
        counts[gid.rsplit(".e", 1)[0]] += 1
        low = min(counts.get(p, 0) for p in problems)
        assert max(counts.values()) - low <= 2, (gid, counts)
