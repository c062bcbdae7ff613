"""The long run under the nemesis (issue 36): a run on a local 3-node replicated cluster (every
topic at replication 3, min ISR 2) while `tests/e2e/nemesis.py` injects faults at seeded random
times, one at a time, for `--minutes`:

- pause (SIGSTOP) of any process (a broker node, the trainer, the server, any stage) for 1-60 s;
- a broker node cut off for 5-60 s: every packet to its client and controller ports dropped, so
  neither the clients nor its peers reach it (its own connections out are not cut: on one
  machine every node is 127.0.0.1, and a packet's owner cannot be told on the loopback);
- the link to the brokers slowed (packets above a rate and 5 % at random dropped) for 10-60 s;
- node 1's disk (a tmpfs) full to the last byte for 30 s (the node halts; restarted once freed);
- a broker node held to 20 % of a core (cgroup) for 60 s;
- the inference server answering 500, or hanging every call, for 10-60 s.

    sudo .venv/bin/python bench/nemesis.py [--minutes 60] [--seed 36] [--name nemesis]
        [--scale 1.0]   # smoke: --minutes 5 --scale 0.25

Root is needed (iptables, tmpfs, cgroups). Every `--every` seconds each process's RSS is read
(with its descendants, as bench/soak.py does); the newest weight version is read as it comes.
At the end the run is stopped (SIGTERM to the launcher) and the topics are read with the outside
view (tests/e2e/outside.py and chaos_checks.py): lost, trained twice, versions gapless, samples
beyond max_lag + 1. Writes `bench/results/<name>.json` (the event log, per fault the seconds from
its end to the next version, the counts, every process's RSS slope in MiB/min) and
`bench/results/<name>.png` (versions, the trained samples' lag, and memory against time, each
fault's span shaded by kind).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "e2e"), str(REPO / "bench")]

import yaml  # noqa: E402
from chaos_checks import _lags, collect, trained  # noqa: E402
from nemesis import (  # noqa: E402
    CpuLimit,
    DiskFull,
    Events,
    Fault,
    Firewall,
    Nemesis,
    Partition,
    Pause,
    ServerFault,
    SlowLink,
    Step,
    child_pid,
    connects,
    require_tools,
    seeded_seconds,
    tmpfs,
)
from nemesis_plot import plot  # noqa: E402  (this folder's)
from outside import Decoder, VersionWatch  # noqa: E402
from soak import _measure, _tree, fit  # noqa: E402

from stream_rl.common.ports import free_port  # noqa: E402
from stream_rl.kafka.cluster import LocalCluster  # noqa: E402

GROUP, STEP, MAX_LAG = 4, 16, 1
KINDS = ["pause", "pause", "partition", "slow-link", "disk-full", "cpu-limit", "server-500", "server-hang"]


def run_config(tmp: Path, bootstrap: str, model: Path, minutes: float) -> dict[str, Any]:
    return {
        "run": "nemesis",
        "runs_dir": str(tmp / "runs"),
        "model": {"path": str(model)},
        "kafka": {
            "bootstrap": bootstrap,
            "partitions": 2,
            "replication_factor": 3,
            "min_insync_replicas": 2,
            "outage_timeout_s": 90,
        },
        "task": {"name": "arithmetic", "params": {"num_problems": 256}},
        "loader": {"epochs": 1000},
        "actor": {
            "group_size": GROUP,
            "max_lag": MAX_LAG,
            "sampling": {"max_tokens": 8},
            "request_timeout_s": 10,
        },
        "inference": {"num_servers": 1, "base_port": free_port(), "max_batch": 32},
        "trainer": {"samples_per_step": STEP, "max_steps": 1_000_000, "bucket_mb": 1, "checkpoint_every": 50},
        "launcher": {
            "restart": True,
            "max_restarts": 1000,
            "max_wall_s": minutes * 60 + 600,
            "stall_timeout_s": 300,
        },
    }


class Sampler(threading.Thread):
    """Every `every` seconds: the RSS (MiB, with descendants) of the launcher, each broker node and
    each child of processes.json, keyed by name (a restarted process continues its name's series,
    its pid noted)."""

    def __init__(self, every: float, pids: Any) -> None:
        super().__init__(daemon=True)
        self.every, self.pids = every, pids
        self.samples: dict[str, list[tuple[float, float, int]]] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.every):
            with contextlib.suppress(Exception):
                tree = _tree()
                named = self.pids()
                exclude = set(named.values())
                for name, pid in named.items():
                    got = _measure(pid, tree, exclude - {pid})
                    if got is not None:
                        self.samples.setdefault(name, []).append((time.time(), got[1] / 2**20, pid))


def slopes(
    samples: dict[str, list[tuple[float, float, int]]],
    skip_s: float,
    end: float = float("inf"),
    floor_s: float = 180,
    ceiling_s: float = 300,
) -> dict[str, dict[str, Any]]:
    """Per process, the RSS slope (MiB/min) of its longest-lived pid after `skip_s` of warm-up and
    before `end` (the stop), that of the last half alone, the floor's (the slope of the least RSS
    of each `floor_s` window) and the ceiling's (of the greatest RSS of each `ceiling_s` window).
    Every stage hands freed C heap back each minute (`stream_rl.common.heap`), so a process that
    allocates in bursts draws a saw whose fitted slope is noise, and the faults cut dips into it
    (a stage waiting on a broker holds less); a leak lifts the ceiling, a saw and a dip do not.
    `ceilings` lists every pid's windows from its start, warm-up included: [minute of the run,
    greatest RSS, pid]."""
    out = {}
    t0 = min((t for pts in samples.values() for t, _r, _p in pts), default=0.0)
    for name, pts in samples.items():
        by_pid = Counter(p for _t, _r, p in pts)
        pid = by_pid.most_common(1)[0][0]
        # RSS 0: the pid was a zombie or exiting (a stage restarting), not a reading of it.
        mine = [(t, r) for t, r, p in pts if p == pid and t <= end and r > 0]
        start = mine[0][0] + skip_s if mine else 0.0
        window = [((t - start) / 60, r) for t, r in mine if t >= start]
        slope, err = fit(window)
        half = [(m, r) for m, r in window if window and m >= window[-1][0] / 2]
        floors: dict[int, tuple[float, float]] = {}
        for m, r in window:
            k = int(m * 60 // floor_s)
            if k not in floors or r < floors[k][1]:
                floors[k] = (m, r)
        floor, floor_err = fit(sorted(floors.values()))
        ceiling, ceiling_err = fit(sorted(_ceilings([(m, r) for m, r in window], ceiling_s)))
        every: list[tuple[float, float, int]] = []
        for p in by_pid:
            run = [((t - t0) / 60, r) for t, r, q in pts if q == p and t <= end and r > 0]
            every += [
                (round(m, 1), r, p) for m, r in _ceilings(run, ceiling_s, origin=run[0][0] if run else 0)
            ]
        out[name] = {
            "pid": pid,
            "restarts": len(by_pid) - 1,
            "minutes": round(window[-1][0] - window[0][0], 1) if window else 0,
            "rss_start_mib": round(window[0][1], 1) if window else None,
            "rss_end_mib": round(window[-1][1], 1) if window else None,
            "slope_mib_per_min": round(slope, 4),
            "stderr": round(err, 4),
            "last_half_slope": round(fit(half)[0], 4),
            "floor_slope": round(floor, 4),
            "floor_stderr": round(floor_err, 4),
            "ceiling_slope": round(ceiling, 4),
            "ceiling_stderr": round(ceiling_err, 4),
            "ceilings": sorted(every),
        }
    return out


def _ceilings(
    points: list[tuple[float, float]], window_s: float, origin: float = 0.0
) -> list[tuple[float, float]]:
    """The greatest reading of each whole `window_s` window from `origin` (minutes, MiB): a last
    window shorter than the others is left out, its maximum being over fewer readings."""
    if not points:
        return []
    best: dict[int, tuple[float, float]] = {}
    for m, r in points:
        k = int((m - origin) * 60 // window_s)
        if k not in best or r > best[k][1]:
            best[k] = (m, r)
    whole = int((points[-1][0] - origin) * 60 // window_s)
    return [best[k] for k in sorted(best) if k < whole]


def make_plan(
    rng: random.Random, seconds: float, cluster: LocalCluster, fw: Firewall, stage_pid: Any, node_pid: Any,
    switch: Path, disk: DiskFull, scale: float = 1.0, only: list[str] | None = None,
) -> list[Step]:  # fmt: skip
    """Faults at random until `seconds` of them and the gaps between (30-90 s) are planned; `only`:
    of these kinds alone (and without the opening 70-s server pause)."""
    plan: list[Step] = []
    total = 0.0
    ports = cluster.layout.ports
    pool = [k for k in KINDS if k in only] if only else KINDS
    kinds = list(pool)
    rng.shuffle(kinds)  # every kind once first, then at random
    # First the case: the server paused 70 s, past the trainer's 60 s update deadline (it
    # once left the run waiting for good: dropped, set aside as stale, then down while stale).
    if not only:
        kinds.append("server-pause-70")
    while total < seconds:
        kind = kinds.pop() if kinds else rng.choice(pool)
        node = rng.randrange(len(ports))
        fault: Fault
        if kind == "server-pause-70":
            fault, held = Pause("pause server-0 70 s", lambda: stage_pid("server-0")), 70.0 / max(scale, 1e-9)
        elif kind == "pause":
            who = rng.choice(["broker", "trainer", "server-0", "actor-0", "verifier-0", "preprocessor-0"])
            held = seeded_seconds(rng, 1, 60)
            if who == "broker":
                fault = Pause(f"pause node {node + 1}", lambda n=node: node_pid(n))
            else:
                fault = Pause(f"pause {who}", lambda w=who: stage_pid(w))
        elif kind == "partition":
            lay = cluster.layout
            mine = [lay.ports[node], lay.controller_ports[node]]
            fault = Partition(
                f"partition node {node + 1}",
                fw,
                ports=mine,
                probe=lambda p=lay.ports[node]: connects("127.0.0.1", p),
            )
            held = seeded_seconds(rng, 5, 60)
        elif kind == "slow-link":
            fault = SlowLink("slow link to the brokers", fw, ports=list(ports), pps=300, loss=0.05)
            held = seeded_seconds(rng, 10, 60)
        elif kind == "disk-full":
            fault, held = disk, 30.0
        elif kind == "cpu-limit":
            fault = CpuLimit(
                f"node {node + 1} cpu 20 %",
                lambda n=node: node_pid(n),
                0.2,
                group=f"srl-nemesis-{os.getpid()}",
            )
            held = 60.0
        else:
            fault = ServerFault(f"server {kind[7:]}", switch, kind[7:])
            held = seeded_seconds(rng, 10, 60)
        gap = seeded_seconds(rng, 30, 90) * scale
        held = round(held * scale, 1)
        plan.append(Step(fault, held, recover_s=300, before_s=gap))
        total += held + gap
    return plan


def counts(data: dict[str, Any]) -> dict[str, Any]:
    """The outside view's checks as numbers (a bench reports; the tests assert)."""
    from chaos_checks import nothing_lost

    ids = [s["rollout_id"] for _v, s in trained(data)]
    versions = sorted({wv["version"] for wv in data["weight-versions"]})
    try:
        nothing_lost(data, GROUP)
        lost: Any = 0
    except AssertionError as exc:
        lost = f"lost: {exc}"
    lags = _lags(data)
    return {
        "trained": len(ids),
        "trained_twice": len(ids) - len(set(ids)),
        "lost": lost,
        "versions": len(versions),
        "gapless": versions == list(range(len(versions))),
        "beyond_lag_bound": sum(1 for lag in lags if lag > MAX_LAG + 1),
        "lags": dict(Counter(lags)),
    }


def warmup_s(given: float | None, minutes: float) -> float:
    return given if given is not None else min(300, minutes * 60 / 4)


def _value(text: str) -> Any:
    """A --set value: JSON where it parses (numbers, true, lists), else the string itself (`off`)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60)
    ap.add_argument("--seed", type=int, default=36)
    ap.add_argument("--name", default="nemesis")
    ap.add_argument("--every", type=float, default=10)
    ap.add_argument(
        "--scale", type=float, default=1.0, help="faults and gaps this times as long (smoke: 0.25)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, data)")
    ap.add_argument(
        "--kinds",
        default="",
        help=f"comma-separated fault kinds to draw from alone (of {sorted(set(KINDS))})",
    )
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="a run-config override, dotted (e.g. launcher.fork_stages=off); repeatable",
    )  # fmt: skip
    ap.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="in the run's environment; repeatable"
    )
    ap.add_argument(
        "--replot",
        metavar="JSON",
        type=Path,
        help="draw the PNG beside a results JSON again, and do nothing else",
    )
    ap.add_argument(
        "--warmup",
        type=float,
        metavar="S",
        help="seconds of each process's start left out of its slopes (default: 300, or a quarter of a shorter run)",
    )
    args = ap.parse_args()
    if args.replot:  # the slopes fitted again too, with this code's rules
        done = json.loads(args.replot.read_text())
        done["slopes"] = slopes(
            done["memory"],
            skip_s=warmup_s(args.warmup, done["minutes"]),
            end=done["t0"] + done["minutes"] * 60,
        )
        done["warmup_s"] = warmup_s(args.warmup, done["minutes"])
        args.replot.write_text(json.dumps(done, indent=1))
        plot(done, args.replot.with_suffix(".png"), MAX_LAG)
        print(f"wrote {args.replot} (slopes) and {args.replot.with_suffix('.png')}")
        return 0
    overrides = [kv.split("=", 1) for kv in args.set]
    extra_env = dict(kv.split("=", 1) for kv in args.env)
    if any(len(kv) != 2 for kv in overrides) or any("=" not in kv for kv in args.env):
        ap.error("--set and --env take KEY=VALUE")
    only = [k for k in args.kinds.split(",") if k]
    if unknown := sorted(set(only) - set(KINDS)):
        ap.error(f"unknown fault kinds {unknown}: choose from {sorted(set(KINDS))}")
    require_tools("iptables")
    from stream_rl.inference.model_maker import make_model

    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="nemesis-"))
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    model = make_model(tmp / "tiny", "tiny", seed=0)
    cluster = LocalCluster(tmp / "kafka", brokers=3, ports=[free_port() for _ in range(3)])
    fw = Firewall(f"SRLNEM{os.getpid()}")
    switch = tmp / "server-faults"
    run_dir = tmp / "runs" / "nemesis"
    result: dict[str, Any] = {"seed": args.seed, "minutes": args.minutes, "kinds": only or sorted(set(KINDS))}
    proc: subprocess.Popen[bytes] | None = None
    with tmpfs(tmp / "kafka" / "node-0", size_mb=128) as node0:
        try:
            bootstrap = cluster.up(quiet=True)
            cfg = run_config(tmp, bootstrap, model, args.minutes)
            for key, value in overrides:
                *path, last = key.split(".")
                node = cfg
                for part in path:
                    node = node.setdefault(part, {})
                node[last] = _value(value)
            result["set"], result["env"] = dict(overrides), extra_env
            (tmp / "run.yaml").write_text(yaml.safe_dump(cfg))
            log = open(tmp / "launcher.log", "w")  # noqa: SIM115 - the child holds it
            proc = subprocess.Popen(
                [sys.executable, "-m", "stream_rl.cli", "run", str(tmp / "run.yaml")],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, **extra_env, "PYTHONUNBUFFERED": "1", "STREAM_RL_SERVER_FAULTS": str(switch)},
            )  # fmt: skip

            def stage_pid(name: str) -> int:
                return child_pid(run_dir, name)

            def node_pid(i: int) -> int:
                st = cluster.node(i).running()
                assert st is not None, f"node {i + 1} does not run"
                return st.pid

            def all_pids() -> dict[str, int]:
                named = {"launcher": proc.pid} if proc else {}
                with contextlib.suppress(OSError, ValueError, KeyError):
                    named.update(json.loads((run_dir / "processes.json").read_text())["pids"])
                for i in range(3):
                    with contextlib.suppress(AssertionError):
                        named[f"kafka-node-{i + 1}"] = node_pid(i)
                return named

            def restart_node0() -> None:
                node = cluster.node(0)
                node.down(quiet=True, timeout=10)
                node.up(quiet=True, wait=False)
                cluster.wait()

            disk = DiskFull(
                "node 1 disk full", node0, lambda: cluster.node(0).running() is not None, restart_node0
            )
            plan = make_plan(
                rng, args.minutes * 60, cluster, fw, stage_pid, node_pid, switch, disk, args.scale, only
            )
            events = Events(tmp / "events.jsonl")
            watch = VersionWatch(bootstrap, "nemesis", Decoder())
            version_times: list[tuple[int, float]] = []

            def version() -> int:
                v = watch.poll()
                if v > (version_times[-1][0] if version_times else -1):
                    version_times.append((v, time.time()))
                return v

            sampler = Sampler(args.every, all_pids)
            sampler.start()
            t0 = time.time()
            finish = time.monotonic() + args.minutes * 60
            # The plan fills --minutes (its last fault's recovery may run past them).
            nemesis = Nemesis(events, version, lambda: proc.poll() is not None)
            nemesis.run(plan)
            while time.monotonic() < finish and proc.poll() is None:
                version()
            sampler.stop.set()
            proc.send_signal(signal.SIGTERM)
            proc.wait(180)
            log.close()
            watch.close()
            data = collect(bootstrap, "nemesis", Decoder())
            trained_at: dict[int, int] = {}
            for v, lag in zip((v for v, _s in trained(data)), _lags(data), strict=False):
                trained_at[v + 1] = max(trained_at.get(v + 1, 0), lag)
            result.update(
                {
                    "t0": t0,
                    "rc": proc.returncode,
                    "events": events.events,
                    "recoveries": [
                        {
                            "fault": s.fault.name,
                            "kind": s.fault.kind,
                            "held_s": s.seconds,
                            "recovered_s": s.result.get("recovered_s"),
                        }
                        for s in plan
                        if s.result
                    ],  # fmt: skip
                    "version_times": version_times,
                    "lag_by_version": {str(k): v for k, v in trained_at.items()},
                    "counts": counts(data),
                    "memory": sampler.samples,
                    "warmup_s": warmup_s(args.warmup, args.minutes),
                    "slopes": slopes(
                        sampler.samples,
                        skip_s=warmup_s(args.warmup, args.minutes),
                        end=t0 + args.minutes * 60,
                    ),
                    "tmp": str(tmp),
                }
            )
        finally:
            if proc is not None and proc.poll() is None:
                proc.kill()
            fw.close()
            cluster.down(quiet=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, default=str, indent=1))
    plot(result, out / f"{args.name}.png", MAX_LAG)
    print(json.dumps({k: result[k] for k in ("rc", "recoveries", "counts", "slopes")}, default=str, indent=1))
    print(f"wrote {out / args.name}.json and .png; logs in {tmp}")
    if result.get("rc") not in (0, None) and not result.get("counts", {}).get("versions"):
        print(f"the run failed (rc {result['rc']}): {tmp / 'launcher.log'}", file=sys.stderr)
        return 1
    if not args.keep:
        subprocess.run(["rm", "-rf", str(tmp)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
