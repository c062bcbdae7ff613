"""`launcher.autoscale`: the launcher resizes a run's servers and stages from the signals it already
measures (`stream_rl/run/autoscale.py` is the policy; docs/autoscaling.md). Off by default."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field, model_validator

from stream_rl.config.base import Model

if TYPE_CHECKING:
    from stream_rl.config.run import RunConfig


class Bounds(Model):
    min: int = Field(1, ge=1)
    """Fewest replicas (a run needs at least one of each)."""
    max: int = Field(1, ge=1)
    """Most replicas."""

    @model_validator(mode="after")
    def _ordered(self) -> Bounds:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is above max ({self.max})")
        return self


class Thresholds(Model):
    trainer_starved: float = Field(0.7, gt=0.0)
    """The trainer starves while its busy fraction (compute time over step time, from the
    versions' `step_s` and `wait_s`) is below this: more generation helps only then."""
    occupancy_high: float = Field(0.6, gt=0.0)
    """Target batch occupancy of the servers (running sequences over `max_batch`, waiting ones
    counted as demand): the fleet wanted is ceil(demand / occupancy_high) servers, as KEDA's
    Prometheus trigger computes it (deploy/k8s/keda.yaml)."""
    occupancy_low: float = Field(0.25, ge=0.0)
    """The actors are too few while the trainer starves and the servers' occupancy is below this."""
    lag_bound_frac: float = Field(0.9, gt=0.0)
    """The lag bound holds the actors back while the mean version lag of trained samples is at least
    this fraction of `actor.max_lag`: no server or actor is added then, one is removed."""
    verifier_lag: int = Field(256, ge=1)
    """Records of `raw-rollouts` behind per verifier: the verifiers wanted are ceil(lag / this)
    (KEDA's Kafka trigger `lagThreshold`)."""
    preprocessor_lag: int = Field(512, ge=1)
    """Records of `scored` behind per preprocessor (as `verifier_lag`)."""


class AutoscaleConfig(Model):
    enabled: bool = False
    """Resize the stages given bounds below during the run (each change as `stream-rl scale` does)."""
    cooldown_s: float = Field(60.0, ge=0.0)
    """Seconds after a stage changed before it changes again."""
    sustain: int = Field(2, ge=1)
    """Consecutive signal samples (one per ~5 s) a condition must hold before it is acted on."""
    servers: Bounds | None = None
    """Launched servers (`inference.num_servers` is the start); unset: not resized."""
    actors: Bounds | None = None
    """Actors (`launcher.actors` is the start); unset: not resized."""
    verifiers: Bounds | None = None
    """Verifiers (`launcher.verifiers` is the start); unset: not resized."""
    preprocessors: Bounds | None = None
    """Preprocessors (`launcher.preprocessors` is the start); unset: not resized."""
    thresholds: Thresholds = Field(default_factory=Thresholds)


STAGES = {"server": "servers", "actor": "actors", "verifier": "verifiers", "preprocessor": "preprocessors"}
"""Role (as `stream-rl scale` names it) -> its key in `launcher.autoscale`."""


def start_counts(cfg: RunConfig) -> dict[str, int]:
    """Replicas of each role the run starts with."""
    lc = cfg.launcher
    return {
        "server": cfg.inference.num_servers,
        "actor": lc.actors,
        "verifier": lc.verifiers,
        "preprocessor": lc.preprocessors,
    }


def autoscale_problem(cfg: RunConfig) -> str | None:
    """Why `launcher.autoscale` cannot work with the rest of the config (one line; None: it can)."""
    auto = cfg.launcher.autoscale
    if not auto.enabled:
        return None
    bounded = {role: getattr(auto, key) for role, key in STAGES.items() if getattr(auto, key) is not None}
    if not bounded:
        return "launcher.autoscale: enabled with no stage to resize: give servers, actors, verifiers or preprocessors {min, max}"
    if "server" in bounded and (cfg.inference.servers or cfg.inference.num_servers == 0):
        return (
            "launcher.autoscale.servers: resizes the servers the launcher starts (inference.num_servers), "
            "not inference.servers; scale those with `stream-rl servers join/leave`"
        )
    starts = start_counts(cfg)
    for role, b in bounded.items():
        n = starts[role]
        if not b.min <= n <= b.max:
            key = "inference.num_servers" if role == "server" else f"launcher.{STAGES[role]}"
            return (
                f"launcher.autoscale.{STAGES[role]}: the run starts with {key}={n}, outside "
                f"[min {b.min}, max {b.max}]"
            )
    th = auto.thresholds
    if th.occupancy_low >= th.occupancy_high:
        return (
            f"launcher.autoscale.thresholds: occupancy_low ({th.occupancy_low}) must be below "
            f"occupancy_high ({th.occupancy_high})"
        )
    return None
