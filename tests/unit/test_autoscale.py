"""`launcher.autoscale`'s policy on a recorded signal sequence (stream_rl/run/autoscale.py): the
decisions it takes, the signal each names, the cool-down and sustain it honours and the min/max it
stays within; its config's one-line errors; its timeline records drawn as a plot panel and shown by
`stream-rl status`."""

from __future__ import annotations

from typing import Any

import pytest

from stream_rl.config import load_config
from stream_rl.config.autoscale import AutoscaleConfig
from stream_rl.errors import ConfigError
from stream_rl.observe.autoscaling import status_lines
from stream_rl.observe.plots import autoscale_panel, panels
from stream_rl.run.autoscale import Policy, ServerSignal, Signals

pytestmark = pytest.mark.unit

MAX_LAG = 2


def auto(**kw: Any) -> AutoscaleConfig:
    base: dict[str, Any] = {"enabled": True, "cooldown_s": 30, "sustain": 2, "servers": {"min": 1, "max": 3}}
    return AutoscaleConfig.model_validate({**base, **kw})


def sample(
    t: float,
    servers: int,
    occ: float,
    busy: float | None,
    lag: float | None = 0.5,
    waiting: float = 0.0,
    **replicas: int,
) -> Signals:
    return Signals(
        t=t,
        replicas={"server": servers, "actor": 1, "verifier": 1, "preprocessor": 1, **replicas},
        servers=[ServerSignal(f"http://s{i}", occ, waiting / servers, 64) for i in range(servers)],
        trainer_busy=busy,
        version_lag=lag,
        lag_bound=MAX_LAG,
    )


def replay(policy: Policy, rows: list[tuple[float, float, float | None, float | None]]) -> list[Any]:
    """Feed (t, occupancy, trainer busy, version lag) samples, the replicas following the decisions."""
    n = 1
    out = []
    for t, occ, busy, lag in rows:
        for d in policy.decide(sample(t, n, occ, busy, lag)):
            assert d.role == "server" and d.before == n
            n = d.after
            out.append(d)
    return out


# A short recorded run (one sample per 5 s): the problems turn long at t=10, the servers fill up and
# the trainer starves; then the trainer becomes the bottleneck, the lag bound holds the actors back
# and the servers empty; at the end the problems run out.
RECORDED = [
    (0.0, 0.30, 0.95, 0.6),
    (5.0, 0.35, 0.92, 0.5),
    (10.0, 0.90, 0.40, 0.4),  # long problems: servers full, trainer waits
    (15.0, 0.92, 0.35, 0.4),  # second sample in a row: server 1 -> 2
    (20.0, 0.85, 0.45, 0.5),  # still hot, but in its cool-down (30 s)
    (25.0, 0.80, 0.50, 0.5),
    (30.0, 0.82, 0.50, 0.5),
    (35.0, 0.81, 0.52, 0.5),
    (40.0, 0.80, 0.55, 0.5),
    (45.0, 0.80, 0.55, 0.6),  # cool-down over (30 s after t=15): server 2 -> 3
    (50.0, 0.90, 0.50, 0.6),
    (55.0, 0.95, 0.50, 0.6),  # at max 3: nothing more
    (60.0, 0.95, 0.55, 0.6),
    (80.0, 0.20, 0.98, 1.9),  # the trainer is the bottleneck: the lag bound holds the actors back
    (85.0, 0.20, 0.99, 1.9),  # second sample: server 3 -> 2, moved by the version lag
    (90.0, 0.30, 0.99, 1.9),  # 0.6 servers' worth: fewer wanted (one sample)
    (120.0, 0.0, None, None),  # out of problems, no new version: fewer wanted again: 2 -> 1
    (125.0, 0.0, None, None),
    (160.0, 0.0, None, None),
    (165.0, 0.0, None, None),  # at min 1: nothing
]


def test_the_recorded_run_grows_then_shrinks_the_fleet_within_its_bounds() -> None:
    decisions = replay(Policy(auto(), MAX_LAG), RECORDED)
    got = [(d.t, d.before, d.after, d.signal) for d in decisions]
    assert got == [
        (15.0, 1, 2, "server occupancy"),
        (45.0, 2, 3, "server occupancy"),
        (85.0, 3, 2, "version lag"),
        (120.0, 2, 1, "server occupancy"),
    ]
    up = decisions[0]
    assert up.value == pytest.approx(0.92) and up.threshold == 0.6
    assert "trainer starves (busy 0.35 < 0.7)" in up.reason, up.reason
    assert "the lag bound holds the actors back" in decisions[2].reason
    # The cool-down holds between any two changes of the role.
    assert all(b.t - a.t >= 30 for a, b in zip(decisions, decisions[1:], strict=False))


def test_sustain_and_cool_down_are_what_the_config_says() -> None:
    hot = [(t * 5.0, 0.9, 0.3, 0.4) for t in range(12)]
    once = replay(Policy(auto(sustain=1, cooldown_s=0), MAX_LAG), hot)
    assert [(d.t, d.after) for d in once] == [(0.0, 2), (5.0, 3)]  # every sample, up to max
    slow = replay(Policy(auto(sustain=3, cooldown_s=20), MAX_LAG), hot)
    assert [(d.t, d.after) for d in slow] == [(10.0, 2), (30.0, 3)]
    # A blip breaks the streak: no decision until the condition held `sustain` samples again.
    blip = [(0.0, 0.9, 0.3, 0.4), (5.0, 0.3, 0.3, 0.4), (10.0, 0.9, 0.3, 0.4), (15.0, 0.9, 0.3, 0.4)]
    assert [d.t for d in replay(Policy(auto(), MAX_LAG), blip)] == [15.0]


def test_no_server_is_added_unless_the_trainer_starves_and_the_lag_bound_leaves_room() -> None:
    fed = [(t * 5.0, 0.95, 0.95, 0.5) for t in range(6)]  # full servers, busy trainer
    assert replay(Policy(auto(), MAX_LAG), fed) == []
    held = [(t * 5.0, 0.95, 0.3, 1.9) for t in range(6)]  # the lag bound holds the actors
    assert replay(Policy(auto(), MAX_LAG), held) == []
    unknown = [(t * 5.0, 0.95, None, None) for t in range(6)]  # no version lately
    assert replay(Policy(auto(), MAX_LAG), unknown) == []


def test_the_queue_counts_as_demand() -> None:
    policy = Policy(auto(sustain=1), MAX_LAG)
    # Half the slots decoding, a batch's worth waiting: 1.5 servers' worth at 0.6 wants 3.
    (d,) = policy.decide(sample(0.0, 1, 0.5, 0.3, waiting=64))
    assert (d.after, d.signal, d.value) == (2, "server occupancy", 1.5)


def test_verifiers_and_preprocessors_follow_their_lag_as_keda_does() -> None:
    cfg = auto(
        sustain=1,
        cooldown_s=10,
        servers=None,
        verifiers={"min": 1, "max": 3},
        preprocessors={"min": 1, "max": 2},
    )
    policy = Policy(cfg, MAX_LAG)
    reps = {"verifier": 1, "preprocessor": 1}
    seen = []
    for t, vlag, plag in [
        (0, 1000, 600),
        (5, 1000, 600),
        (10, 1000, 2000),
        (20, 1000, 2000),
        (30, 100, 0),
        (40, 0, 0),
    ]:
        s = Signals(
            t=t, replicas={**reps, "server": 1, "actor": 1}, lags={"verifier": vlag, "preprocessor": plag}
        )
        for d in policy.decide(s):
            reps[d.role] = d.after
            seen.append((t, d.role, d.after, d.signal))
    assert seen == [
        (0, "verifier", 2, "verifier lag"),  # ceil(1000/256) = 4, one at a time
        (0, "preprocessor", 2, "preprocessor lag"),  # ceil(600/512) = 2
        (10, "verifier", 3, "verifier lag"),  # 5 s later: cool-down; preprocessor at max
        (30, "verifier", 2, "verifier lag"),
        (30, "preprocessor", 1, "preprocessor lag"),
        (40, "verifier", 1, "verifier lag"),
    ]


def test_actors_are_added_when_the_servers_idle_and_removed_when_the_bound_holds() -> None:
    policy = Policy(auto(sustain=1, cooldown_s=0, servers=None, actors={"min": 1, "max": 2}), MAX_LAG)
    (d,) = policy.decide(sample(0.0, 1, 0.1, 0.3, 0.2, actor=1))
    assert (d.role, d.after, d.signal) == ("actor", 2, "trainer busy")
    (d,) = policy.decide(sample(5.0, 1, 0.1, 0.9, 2.0, actor=2))
    assert (d.role, d.after, d.signal) == ("actor", 1, "version lag")


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["launcher.autoscale.enabled=true"], "enabled with no stage to resize"),
        (["launcher.autoscale.servers={min: 3, max: 2}"], "min (3) is above max (2)"),
        (
            ["launcher.autoscale.enabled=true", "launcher.autoscale.servers={min: 2, max: 3}"],
            "starts with inference.num_servers=1, outside [min 2, max 3]",
        ),
        (
            ["launcher.autoscale.enabled=true", "launcher.autoscale.actors={max: 3}", "launcher.actors=4"],
            "starts with launcher.actors=4",
        ),
        (
            [
                "launcher.autoscale.enabled=true",
                "launcher.autoscale.servers={max: 3}",
                "inference.servers=[{url: http://10.0.0.1:8000}]",
            ],
            "not inference.servers",
        ),
        (
            [
                "launcher.autoscale.enabled=true",
                "launcher.autoscale.verifiers={max: 2}",
                "launcher.autoscale.thresholds.occupancy_low=0.9",
            ],
            "occupancy_low (0.9) must be below occupancy_high (0.6)",
        ),
        (["launcher.autoscale.cooldown=5"], "unknown key"),
    ],
)
def test_config_errors_are_one_line(sets: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, sets)
    text = str(err.value)
    assert message in text and "\n" not in text, text


def test_off_by_default_and_a_valid_config_loads() -> None:
    assert not load_config(None).launcher.autoscale.enabled
    cfg = load_config(None, ["launcher.autoscale.enabled=true", "launcher.autoscale.servers={max: 3}"])
    assert cfg.launcher.autoscale.servers is not None and cfg.launcher.autoscale.servers.max == 3


def timeline() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"t": 0.0, "kind": "start"}]
    n = 1
    for i, (t, occ, _busy, _lag) in enumerate(RECORDED):
        if i in (3, 9):
            out.append({"t": t, "kind": "autoscale", "role": "server", "before": n, "after": n + 1, "signal": "server occupancy", "reason": "r", "error": None})  # fmt: skip
            n += 1
        out.append(
            {"t": t, "kind": "replicas", "replicas": {"server": n, "actor": 1}, "signals": {"occupancy": occ}}
        )
    return out


def test_the_plot_panel_draws_replicas_and_each_decision_with_its_signal() -> None:
    panel = autoscale_panel(timeline())
    assert panel is not None
    lines = {line.label: line for line in panel.lines}
    assert set(lines) == {"server", "server +1: server occupancy"}  # the actors never changed
    assert lines["server"].ys[0] == 1 and lines["server"].ys[-1] == 3
    assert lines["server +1: server occupancy"].xs == [15.0, 45.0]
    assert "autoscale" not in panels([{"t": 0.0, "kind": "start"}])  # a run without autoscale


def test_status_shows_the_replicas_and_the_last_decisions() -> None:
    state = {
        "replicas": {"server": 2, "actor": 1},
        "bounds": {"server": {"min": 1, "max": 3}},
        "cooldown_s": 30,
        "signals": {"occupancy": 0.81, "trainer_busy": 0.4, "version_lag": None},
        "decisions": [
            {
                "wall_time": 0,
                "role": "server",
                "before": 1,
                "after": 2,
                "signal": "server occupancy",
                "reason": "full",
                "error": None,
            }  # fmt: skip
        ],
    }
    head, last = status_lines(state)
    assert head.startswith(
        "autoscale: server 2 (1-3); cool-down 30 s; server occupancy 0.81, trainer busy 0.40"
    )
    assert "server 1 -> 2 [server occupancy]: full" in last
