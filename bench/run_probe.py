"""What `bench/pipeline_vs_conventional.py` measures while a launched run goes, and how it turns a
finished run into figures. Linux only (reads /proc).

`RunProbe` (a thread) samples every `every_s` seconds:
- the CPU seconds (user + system) of every process of the run, attributed to the launcher's child
  that started it (`runs/<run>/processes.json` names them; a verifier's scoring workers count as
  the verifier), plus the launcher itself and the Kafka broker;
- the machine's busy CPU seconds (/proc/stat), so `machine - ours` is what other work took;
- each inference server's `/metrics`: `busy_seconds` (engine working), generated tokens, and the
  batch occupancy figures (`running` sequences and `max_batch` slots at the sample, and the
  `sequence_seconds` integral, whose rate over `max_batch` is the mean occupancy between samples),
  summed over the servers.
With `pin_trainer` it also pins CPUs, to stand in for PipelineRL's separate devices: every thread
of the trainer to those CPUs, every thread of the inference servers to the remaining ones. The
host-side work (actor, verifier, preprocessor, loader, the broker) stays unpinned, as CPU work
beside GPUs would: pinned onto the servers' core, the broker starved for 30 s and runs died.

`analyze()` reads the run's timeline (`weight-versions` lineage, stage offsets) and the probe's
samples and returns one flat dict of figures over the training window, from the publication of
version 0 (`init`, training can start) to that of the last version: wall time to a target
reward, throughput, busy/idle fractions, version lag, ESS, final reward, CPU per stage.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx

CLOCK_TICK = os.sysconf("SC_CLK_TCK")
SERVER_COUNTERS = {
    "stream_rl_inference_busy_seconds_total": "busy_s",
    "stream_rl_inference_generated_tokens_total": "generated_tokens",
    "stream_rl_inference_finished_requests_total": "finished_requests",
    "stream_rl_inference_sequence_seconds_total": "sequence_s",
    "stream_rl_inference_running": "running",
    "stream_rl_inference_max_batch": "max_batch",
}
LAG_KEY = "version_lag_n"
"""Per-version counts of samples by lag (`stream_rl/train/step_runner.py`)."""


def role_of(name: str) -> str:
    """`actor-0` -> `actor`, `server-1` -> `server`, `trainer` -> `trainer`."""
    head, _, tail = name.rpartition("-")
    return head if head and tail.isdigit() else name


def read_proc_stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, CPU seconds: user + system) of a live process, None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / CLOCK_TICK


def machine_busy_s() -> float:
    """Busy CPU seconds of the whole machine since boot (all cores; idle and iowait excluded)."""
    values = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(values[:8]) - values[3] - values[4]) / CLOCK_TICK


def scrape_counters(url: str, timeout: float = 2.0) -> dict[str, float]:
    """The server counters of SERVER_COUNTERS from `url/metrics` (empty if it does not answer)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=timeout).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in SERVER_COUNTERS:
            out[SERVER_COUNTERS[name]] = float(value)
    return out


class RunProbe(threading.Thread):
    def __init__(
        self,
        run_dir: Path,
        launcher_pid: int,
        broker_dir: Path,
        every_s: float = 1.0,
        pin_trainer: set[int] | None = None,
    ) -> None:
        """The launcher's children are found in `run_dir/processes.json`, the broker it starts in
        `broker_dir/broker.json`, once they exist."""
        super().__init__(name="run-probe", daemon=True)
        self.run_dir = run_dir
        self.broker_dir = broker_dir
        self.roots: dict[str, int] = {"launcher": launcher_pid}
        self.every_s = every_s
        self.samples: list[dict[str, Any]] = []
        self.servers: list[str] = []
        self._cpu: dict[int, tuple[str, float]] = {}  # pid -> (owner, last CPU seconds seen)
        self._have_children = False
        self.pin: dict[str, set[int]] | None = None
        if pin_trainer:
            rest = os.sched_getaffinity(0) - pin_trainer
            if not rest:
                raise ValueError(
                    f"pinning the trainer to CPUs {sorted(pin_trainer)} leaves none for the rest"
                )
            self.pin = {"trainer": set(pin_trainer), "server": rest}
        self._pinned: set[int] = set()
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(self.every_s)

    def _children(self) -> None:
        if "broker" not in self.roots and (self.broker_dir / "broker.json").exists():
            with contextlib.suppress(OSError, ValueError, KeyError):  # being written: next time
                self.roots["broker"] = int(json.loads((self.broker_dir / "broker.json").read_text())["pid"])
        if self._have_children or not (self.run_dir / "processes.json").exists():
            return
        try:
            info = json.loads((self.run_dir / "processes.json").read_text())
        except (OSError, json.JSONDecodeError):
            return  # being written
        self._have_children = True
        self.roots.update(info.get("pids", {}))
        self.servers = list(info.get("servers", []))

    def _pin(self, pid: int, cpus: set[int]) -> None:
        """Pin every thread of `pid` not pinned yet (threads it creates later inherit it)."""
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            return  # gone
        for tid in tids:
            if tid not in self._pinned:
                with contextlib.suppress(OSError):  # the thread ended meanwhile
                    os.sched_setaffinity(tid, cpus)
                    self._pinned.add(tid)

    def sample(self) -> None:
        self._children()
        owners = {pid: name for name, pid in self.roots.items()}
        parents: dict[int, int] = {}
        cpu: dict[int, float] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (stat := read_proc_stat(entry)) is not None:
                parents[int(entry)], cpu[int(entry)] = stat
        for pid, seconds in cpu.items():
            node, hops = pid, 0
            while node not in owners and node in parents and hops < 16:
                node, hops = parents[node], hops + 1
            if node in owners:
                self._cpu[pid] = (owners[node], seconds)  # a process that ends keeps its last figure
                role = role_of(owners[node])
                if self.pin is not None and self._have_children and role in self.pin:
                    self._pin(pid, self.pin[role])
        per_owner: dict[str, float] = {}
        for owner, seconds in self._cpu.values():
            per_owner[role_of(owner)] = per_owner.get(role_of(owner), 0.0) + seconds
        server: dict[str, float] = {}
        for url in self.servers:
            for key, value in scrape_counters(url).items():
                server[key] = server.get(key, 0.0) + value
        self.samples.append(
            {"t": time.time(), "cpu": per_owner, "machine_s": machine_busy_s(), "server": server}
        )


# -- analysis of a finished run ----------------------------------------------------------------


def versions_of(timeline: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per version (the first, if one was re-published), by version."""
    seen: dict[int, dict[str, Any]] = {}
    for r in timeline:
        if r.get("kind") == "version" and r["version"] not in seen:
            seen[r["version"]] = r
    return [seen[v] for v in sorted(seen)]


def fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def centered_mean(values: list[float], window: int) -> list[float]:
    """Mean over `window` neighbours centred on each point (fewer at the edges)."""
    half = window // 2
    return [statistics.fmean(values[max(0, i - half) : i + half + 1]) for i in range(len(values))]


def time_to_target(curve: list[tuple[float, float]], target: float, window: int) -> float | None:
    """First time at which the centred moving mean of (time, reward) reaches `target`."""
    smooth = centered_mean([r for _, r in curve], window)
    return next((t for (t, _), r in zip(curve, smooth, strict=True) if r >= target), None)


def interpolate(points: list[tuple[float, float]], t: float) -> float | None:
    """Linear interpolation of a cumulative series at time t (clamped to its ends)."""
    if not points:
        return None
    times = [p[0] for p in points]
    i = bisect.bisect_left(times, t)
    if i == 0:
        return points[0][1]
    if i == len(points):
        return points[-1][1]
    (t0, v0), (t1, v1) = points[i - 1], points[i]
    return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v1


def delta(points: list[tuple[float, float]], start: float, end: float) -> float | None:
    a, b = interpolate(points, start), interpolate(points, end)
    return None if a is None or b is None else b - a


def analyze(
    timeline: list[dict[str, Any]], samples: list[dict[str, Any]], target: float, window: int
) -> dict[str, Any]:
    """Figures of one run over its training window (see the module docstring). Times are seconds
    since version 0 was published."""
    versions = versions_of(timeline)
    if len(versions) < 2:
        return {"error": "fewer than two versions published"}
    t0 = versions[0]["created_ms"] / 1000
    updates = versions[1:]
    end = updates[-1]["created_ms"] / 1000
    span = max(end - t0, 1e-9)
    times = [v["created_ms"] / 1000 - t0 for v in updates]
    rewards = [float(v.get("reward_mean", 0.0)) for v in updates]
    curve = list(zip(times, rewards, strict=True))
    reached = time_to_target(curve, target, window)
    at = next((v for v, t in zip(updates, times, strict=True) if t == reached), None)

    def metric(name: str) -> list[float]:
        return [float(v[name]) for v in updates if name in v]

    start_wall = next((r["wall_time"] for r in timeline if r.get("kind") == "start"), t0)
    actor = [
        (start_wall + r["t"], float(r["offsets"]["actor"])) for r in timeline if r.get("kind") == "offsets"
    ]
    generated = delta(actor, t0, end)
    out: dict[str, Any] = {
        "versions": updates[-1]["version"],
        "window_s": span,
        "time_to_target_s": reached,
        "version_at_target": at["version"] if at else None,
        "samples_at_target": at["samples_trained"] if at else None,
        "final_reward": statistics.fmean(rewards[-window:]),
        "first_reward": statistics.fmean(rewards[:window]),
        "samples_trained": updates[-1]["samples_trained"],
        "trained_samples_per_s": (updates[-1]["samples_trained"] - versions[0]["samples_trained"]) / span,
        "generated_samples_per_s": generated / span if generated is not None else None,
        "step_s_mean": statistics.fmean(metric("step_s")) if metric("step_s") else None,
        "trainer_busy": sum(metric("compute_s")) / span,
        "trainer_broadcast": sum(v.get("broadcast_ms", 0.0) for v in updates) / 1000 / span,
        "version_lag_mean": statistics.fmean(metric("version_lag_mean"))
        if metric("version_lag_mean")
        else None,
        "version_lag_max": max(metric("version_lag_max"), default=None),
        "version_lag_token_mean": (
            statistics.fmean(metric("version_lag_token_mean")) if metric("version_lag_token_mean") else None
        ),
        "ess_mean": statistics.fmean(metric("ess")) if metric("ess") else None,
        "ess_min": min(metric("ess"), default=None),
        "curve": [
            {"t": t, "version": v["version"], "samples": v["samples_trained"], "reward": r}
            for t, v, r in zip(times, updates, rewards, strict=True)
        ],
    }
    server = {
        k: [(s["t"], s["server"][k]) for s in samples if k in s["server"]] for k in SERVER_COUNTERS.values()
    }
    busy = delta(server["busy_s"], t0, end)
    tokens = delta(server["generated_tokens"], t0, end)
    out["inference_idle"] = 1 - busy / span if busy is not None else None
    out["generated_tokens_per_s"] = tokens / span if tokens is not None else None
    out.update(occupancy(samples, t0, end))
    out.update(lag_distribution(updates))
    roles = sorted({k for s in samples for k in s["cpu"]})
    cpu = {r: delta([(s["t"], s["cpu"].get(r, 0.0)) for s in samples], t0, end) for r in roles}
    out["cpu_cores"] = {r: round(v / span, 3) for r, v in cpu.items() if v is not None}
    run_cpu = sum(v for v in cpu.values() if v is not None)
    out["broker_share"] = cpu["broker"] / run_cpu if run_cpu and cpu.get("broker") is not None else None
    steps = len(updates)
    out["cpu_s_per_step"] = {r: round(v / steps, 3) for r, v in cpu.items() if v is not None}
    ours = [(s["t"], sum(s["cpu"].values())) for s in samples]
    ours_window = delta(ours, t0, end)
    # CPU-normalised figures: on a shared machine the wall time also depends on the share of the
    # cores the run gets; its own CPU seconds do not.
    out["samples_per_cpu_s"] = out["samples_trained"] / ours_window if ours_window else None
    out["cpu_s_to_target"] = delta(ours, t0, t0 + reached) if reached is not None else None
    machine = delta([(s["t"], s["machine_s"]) for s in samples], t0, end)
    if machine is not None:
        out["machine_cores_busy"] = machine / span
        out["other_work_cores"] = max(0.0, machine / span - sum(out["cpu_cores"].values()))
    return out


def occupancy(samples: list[dict[str, Any]], t0: float, end: float) -> dict[str, Any]:
    """Engine batch occupancy (running sequences / max batch) over [t0, end]: the mean from the
    servers' `sequence_seconds` integral, and the series of per-interval means (time since t0)."""
    rows = [s for s in samples if "sequence_s" in s["server"] and s["server"].get("max_batch")]
    if len(rows) < 2:
        return {"occupancy": None, "occupancy_series": []}
    slots = rows[-1]["server"]["max_batch"]
    integral = delta([(s["t"], s["server"]["sequence_s"]) for s in rows], t0, end)
    series = []
    for a, b in zip(rows, rows[1:], strict=False):
        if a["t"] >= t0 and b["t"] <= end and b["t"] > a["t"]:
            rate = (b["server"]["sequence_s"] - a["server"]["sequence_s"]) / (b["t"] - a["t"])
            series.append({"t": round(b["t"] - t0, 2), "occupancy": round(rate / slots, 4)})
    mean = integral / (end - t0) / slots if integral is not None and end > t0 else None
    return {"occupancy": mean, "occupancy_series": series, "max_batch": slots}


def lag_distribution(updates: list[dict[str, Any]]) -> dict[str, Any]:
    """Trained samples by version lag (oldest span), summed over the run's versions, and its
    quantiles; the last-token lag's mean and max."""
    counts: dict[int, int] = {}
    for v in updates:
        for key, value in v.items():
            if key.startswith(LAG_KEY) and key[len(LAG_KEY) :].isdigit():
                lag = int(key[len(LAG_KEY) :])
                counts[lag] = counts.get(lag, 0) + int(value)
    total = sum(counts.values())
    out: dict[str, Any] = {"lag_counts": {str(k): counts[k] for k in sorted(counts)}}
    for name, q in (("lag_p50", 0.5), ("lag_p90", 0.9), ("lag_p99", 0.99)):
        seen, value = 0, None
        for lag in sorted(counts):
            seen += counts[lag]
            if seen >= q * total:
                value = lag
                break
        out[name] = value
    last = [float(v["version_lag_last_mean"]) for v in updates if "version_lag_last_mean" in v]
    out["version_lag_last_mean"] = statistics.fmean(last) if last else None
    out["version_lag_last_max"] = max(
        (float(v["version_lag_last_max"]) for v in updates if "version_lag_last_max" in v), default=None
    )
    return out
