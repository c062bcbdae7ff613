"""`launcher.autoscale`: the launcher resizes the run's servers and stages from the signals it
already measures (docs/autoscaling.md).

`Policy` is pure: a `Signals` sample in, `Decision`s out (each naming the signal that moved it).
Per role, one replica at a time, within the configured `min`/`max`, once its condition held for
`sustain` samples in a row and `cooldown_s` after the role last changed:

- **server**: the fleet wanted is ceil(demand / occupancy_high), demand being the servers' batch
  occupancy summed (running sequences over `max_batch`, averaged since the last sample) plus their
  waiting sequences in batches (KEDA's Prometheus trigger computes the same: deploy/k8s/keda.yaml).
  One is added when more are wanted, the trainer starves (busy fraction under `trainer_starved`)
  and the lag bound does not hold the actors back (more generation helps only then); one is
  removed when fewer are wanted (while the lag bound holds the actors back, the servers idle).
- **actor**: one is added while the trainer starves, the servers are under `occupancy_low` and the
  lag bound does not hold the actors (they send too little); one is removed while it does (the
  actors share the bound by partition: more of them only idle).
- **verifier, preprocessor**: ceil(lag of their group / `verifier_lag` or `preprocessor_lag`)
  wanted, KEDA's Kafka trigger's arithmetic with the same `lagThreshold`.

`Autoscaler` is the launcher's side: at each of the monitor's samples (every ~5 s) it reads the
servers' `/metrics` and the versions the monitor saw, asks the policy, applies each decision
through `stream-rl scale`'s code (`Scaling.scale_to`), and records it: a line in the launcher's log,
an `autoscale` record in the timeline (and a `replicas` record per sample, for the plot), and
`runs/<run>/autoscale.json` for `stream-rl status`.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stream_rl.config.autoscale import STAGES, AutoscaleConfig, Bounds
from stream_rl.errors import StreamRLError
from stream_rl.observe.autoscaling import STATE

if TYPE_CHECKING:
    from stream_rl.contracts import WeightVersion
    from stream_rl.run.launch import Launcher
    from stream_rl.run.monitor import RunMonitor

KEEP_DECISIONS = 20
TRAINER_WINDOW_S = 20.0
"""The trainer's busy fraction and version lag are read over the versions of the last this many seconds."""


@dataclass
class ServerSignal:
    url: str
    occupancy: float
    """Share of the server's batch slots decoding, averaged since the last sample."""
    waiting: float = 0.0
    """Sequences waiting for a slot (its queue)."""
    max_batch: float = 1.0


@dataclass
class Signals:
    """What the run measured at one sample."""

    t: float
    """Seconds since the launcher's monitor started."""
    replicas: dict[str, int]
    lags: dict[str, int] = field(default_factory=dict)
    """Consumer lag per group (role), in records."""
    servers: list[ServerSignal] = field(default_factory=list)
    """The servers whose `/metrics` answered."""
    trainer_busy: float | None = None
    """Compute time over step time of the trainer's recent versions (None: none lately)."""
    version_lag: float | None = None
    """Mean version lag of the samples the recent versions trained."""
    lag_bound: int = 0
    """`actor.max_lag` (0 in conventional mode: never held back by it)."""

    @property
    def demand(self) -> float | None:
        """Servers' worth of sequences: occupancy summed plus the queues in batches."""
        if not self.servers:
            return None
        return sum(s.occupancy + s.waiting / max(s.max_batch, 1.0) for s in self.servers)

    @property
    def occupancy(self) -> float | None:
        """Mean batch occupancy (queues counted as demand) of the servers."""
        demand = self.demand
        return None if demand is None else demand / len(self.servers)

    def summary(self) -> dict[str, Any]:
        def r(x: float | None) -> float | None:
            return None if x is None else round(x, 3)

        return {
            "lags": self.lags,
            "occupancy": r(self.occupancy),
            "waiting": sum(s.waiting for s in self.servers),
            "trainer_busy": r(self.trainer_busy),
            "version_lag": r(self.version_lag),
        }


@dataclass
class Decision:
    role: str
    before: int
    after: int
    signal: str
    """The signal that moved it: `server occupancy`, `trainer busy`, `version lag`, `verifier lag`, ..."""
    value: float
    threshold: float
    reason: str
    t: float = 0.0

    def line(self) -> str:
        return f"{self.role} {self.before} -> {self.after}: {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Rule:
    direction: int  # +1, -1
    signal: str
    value: float
    threshold: float
    reason: str


class Policy:
    """The decisions of `launcher.autoscale` (module docstring), from signal samples alone."""

    def __init__(self, config: AutoscaleConfig, lag_bound: int) -> None:
        self.config = config
        self.lag_bound = lag_bound
        self.bounds: dict[str, Bounds] = {
            role: b for role, key in STAGES.items() if (b := getattr(config, key)) is not None
        }
        self._streak: dict[str, tuple[int, int]] = {}
        self._changed: dict[str, float] = {}

    def decide(self, s: Signals) -> list[Decision]:
        """The changes to make now; each is taken as made (its role's cool-down starts)."""
        out = []
        for role, bounds in self.bounds.items():
            n = s.replicas.get(role)
            if n is None:
                continue
            rule = self._rule(role, n, s)
            if rule is None:
                self._streak.pop(role, None)
                continue
            after = min(max(n + rule.direction, bounds.min), bounds.max)
            if after == n:
                self._streak.pop(role, None)
                continue
            direction, count = self._streak.get(role, (0, 0))
            count = count + 1 if direction == rule.direction else 1
            self._streak[role] = (rule.direction, count)
            if count < self.config.sustain:
                continue
            if s.t - self._changed.get(role, -math.inf) < self.config.cooldown_s:
                continue
            self._changed[role] = s.t
            self._streak.pop(role, None)
            out.append(Decision(role, n, after, rule.signal, rule.value, rule.threshold, rule.reason, s.t))
        return out

    def _held(self, s: Signals) -> bool:
        """The lag bound holds the actors back."""
        frac = self.config.thresholds.lag_bound_frac
        return s.version_lag is not None and self.lag_bound > 0 and s.version_lag >= frac * self.lag_bound

    def _starving(self, s: Signals) -> bool:
        return s.trainer_busy is not None and s.trainer_busy < self.config.thresholds.trainer_starved

    def _rule(self, role: str, n: int, s: Signals) -> _Rule | None:
        th = self.config.thresholds
        held = self._held(s)
        held_why = (
            f"version lag {s.version_lag:.2f} >= {th.lag_bound_frac:g} x max_lag {self.lag_bound}: "
            "the lag bound holds the actors back"
            if held and s.version_lag is not None
            else ""
        )
        if role == "server":
            demand, occ = s.demand, s.occupancy
            if demand is None or occ is None:
                return None
            want = math.ceil(demand / th.occupancy_high - 1e-9)
            if want > n and self._starving(s) and not held:
                assert s.trainer_busy is not None
                return _Rule(
                    +1, "server occupancy", occ, th.occupancy_high,
                    f"server occupancy {occ:.2f} >= {th.occupancy_high:g} while the trainer starves "
                    f"(busy {s.trainer_busy:.2f} < {th.trainer_starved:g})",
                )  # fmt: skip
            if want < n:
                if held:
                    assert s.version_lag is not None
                    return _Rule(
                        -1, "version lag", s.version_lag, th.lag_bound_frac * self.lag_bound,
                        f"{held_why}; server occupancy {occ:.2f} fits {n - 1} server(s)",
                    )  # fmt: skip
                return _Rule(
                    -1, "server occupancy", occ, th.occupancy_high,
                    f"server occupancy {occ:.2f}: the demand ({demand:.2f} servers' worth) fits {n - 1} "
                    f"at {th.occupancy_high:g}",
                )  # fmt: skip
            return None
        if role == "actor":
            if held:
                assert s.version_lag is not None
                return _Rule(-1, "version lag", s.version_lag, th.lag_bound_frac * self.lag_bound, held_why)
            occ = s.occupancy
            if self._starving(s) and occ is not None and occ < th.occupancy_low:
                assert s.trainer_busy is not None
                return _Rule(
                    +1, "trainer busy", s.trainer_busy, th.trainer_starved,
                    f"trainer busy {s.trainer_busy:.2f} < {th.trainer_starved:g} with server occupancy "
                    f"{occ:.2f} < {th.occupancy_low:g}: the actors send too little",
                )  # fmt: skip
            return None
        per = th.verifier_lag if role == "verifier" else th.preprocessor_lag
        lag = s.lags.get(role)
        if lag is None:
            return None
        want = max(math.ceil(lag / per), 1)
        if want == n:
            return None
        verb = "over" if want > n else "within"
        return _Rule(
            +1 if want > n else -1, f"{role} lag", float(lag), float(per),
            f"{role} lag {lag} records: {verb} {per} per replica for {n}",
        )  # fmt: skip


# -- the launcher's side ---------------------------------------------------------------------


def _occupancy(
    metrics: dict[str, float], prev: tuple[float, dict[str, float]] | None, now: float, max_batch: float
) -> float:
    """Batch occupancy since `prev` from the built-in server's `sequence_seconds` counter, else the
    running sequences now."""
    key = "stream_rl_inference_sequence_seconds_total"
    if prev is not None and key in metrics and key in prev[1] and now > prev[0]:
        rate = (metrics[key] - prev[1][key]) / (now - prev[0])
        return max(rate, 0.0) / max(max_batch, 1.0)
    from stream_rl.run.servers import LOAD_METRICS

    running = next((metrics[k] for k, _ in LOAD_METRICS.values() if k in metrics), 0.0)
    return running / max(max_batch, 1.0)


class Autoscaler:
    """Samples the signals at the monitor's pace, applies the policy's decisions (module docstring)."""

    def __init__(self, launcher: Launcher, monitor: RunMonitor) -> None:
        cfg = launcher.config
        self.launcher = launcher
        self.monitor = monitor
        self.config = cfg.launcher.autoscale
        self.policy = Policy(self.config, cfg.lag_bound)
        self.path: Path = launcher.run_dir / STATE
        self._seen: object = None
        self._prev: dict[str, tuple[float, dict[str, float]]] = {}
        self._versions: deque[tuple[float, WeightVersion]] = deque(maxlen=256)
        self._decisions: deque[dict[str, Any]] = deque(maxlen=KEEP_DECISIONS)

    def replicas(self) -> dict[str, int]:
        counts = dict.fromkeys(STAGES, 0)
        for child in self.launcher.children:
            if child.role in counts:
                counts[child.role] += 1
        return counts

    def signals(self) -> Signals:
        from stream_rl.observe.status import scrape
        from stream_rl.run.servers import LOAD_METRICS

        cfg = self.launcher.config
        now = time.monotonic()
        servers = []
        for url in self.launcher.server_urls():
            metrics = scrape(f"{url}/metrics", timeout=2.0)
            if metrics is None:
                continue
            max_batch = metrics.get("stream_rl_inference_max_batch", float(cfg.inference.max_batch))
            occ = _occupancy(metrics, self._prev.get(url), now, max_batch)
            self._prev[url] = (now, metrics)
            waiting = next((metrics[w] for _, w in LOAD_METRICS.values() if w in metrics), 0.0)
            servers.append(ServerSignal(url, occ, waiting, max_batch))
        for wv in self.monitor.recent:
            if not self._versions or wv.version > self._versions[-1][1].version:
                self._versions.append((now, wv))
        recent = [wv for seen, wv in self._versions if now - seen <= TRAINER_WINDOW_S and wv.version > 0]
        step = sum(float(wv.metrics.get("step_s", 0.0)) for wv in recent)
        wait = sum(
            min(float(wv.metrics.get("wait_s", 0.0)), float(wv.metrics.get("step_s", 0.0))) for wv in recent
        )
        lags = [float(wv.metrics["version_lag_mean"]) for wv in recent if "version_lag_mean" in wv.metrics]
        sample = self.monitor.sample
        return Signals(
            t=round(time.time() - self.monitor.t0, 3),
            replicas=self.replicas(),
            lags=dict(sample.lags) if sample is not None else {},
            servers=servers,
            trainer_busy=(step - wait) / step if step > 0 else None,
            version_lag=sum(lags) / len(lags) if lags else None,
            lag_bound=cfg.lag_bound,
        )

    def tick(self) -> None:
        """At each new monitor sample: measure, decide, apply, record."""
        sample = self.monitor.sample
        if sample is None or sample is self._seen:
            return
        self._seen = sample
        signals = self.signals()
        for decision in self.policy.decide(signals):
            self.apply(decision)
        self.monitor.record({"kind": "replicas", "replicas": self.replicas(), "signals": signals.summary()})
        self._write_state(signals)

    def apply(self, decision: Decision) -> None:
        """Through `stream-rl scale`'s code; a refusal (a port taken, ...) is recorded, not raised."""
        lines: list[str] = []
        error = None
        print(f"\nautoscale: {decision.line()}", flush=True)
        try:
            self.launcher.scale_to({decision.role: decision.after}, lines.append)
        except StreamRLError as exc:
            error = str(exc)
        for line in lines:
            print(f"autoscale: {line}", flush=True)
        if error:
            print(f"autoscale: {decision.role} not changed: {error}", flush=True)
        record = {"kind": "autoscale", **decision.to_dict(), "error": error}
        self.monitor.record(record)
        self._decisions.append({**record, "wall_time": time.time()})

    def _write_state(self, signals: Signals) -> None:
        state = {
            "replicas": self.replicas(),
            "bounds": {role: b.model_dump() for role, b in self.policy.bounds.items()},
            "cooldown_s": self.config.cooldown_s,
            "signals": signals.summary(),
            "decisions": list(self._decisions),
            "updated": time.time(),
        }
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.path)  # readers never see half a file


def autoscaler_for(launcher: Launcher, monitor: RunMonitor) -> Autoscaler | None:
    """The run's autoscaler (None with `launcher.autoscale.enabled` off)."""
    if not launcher.config.launcher.autoscale.enabled:
        return None
    auto = launcher.config.launcher.autoscale
    bounds = ", ".join(f"{role} {b.min}-{b.max}" for role, key in STAGES.items() if (b := getattr(auto, key)))
    print(f"autoscale: on ({bounds}; cool-down {auto.cooldown_s:g} s)", flush=True)
    return Autoscaler(launcher, monitor)
