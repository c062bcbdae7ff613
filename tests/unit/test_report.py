"""Summary and plots of a run, from a synthetic timeline."""

from __future__ import annotations

from pathlib import Path

import pytest

from stream_rl.config import load_config
from stream_rl.observe.report import summarize, write_plots

pytestmark = pytest.mark.unit


def timeline() -> list[dict]:  # type: ignore[type-arg]
    out: list[dict] = [{"t": 0.0, "kind": "start"}]  # type: ignore[type-arg]
    for v in range(11):
        out.append(
            {
                "t": 2.0 * v,
                "kind": "version",
                "version": v,
                "step": v,
                "samples_trained": 64 * v,
                "tokens_trained": 640 * v,
                "broadcast_ms": 5.0 + v,
                "servers_failed": 0,
                **(
                    {"reward_mean": 0.1 * v, "version_lag_mean": 0.5, "version_lag_max": 1, "ess": 0.99}
                    if v
                    else {}
                ),
            }
        )
        out.append(
            {
                "t": 2.0 * v + 1,
                "kind": "offsets",
                "offsets": {"loader": 1000, "actor": 100 * v, "verifier": 90 * v, "preprocessor": 10 * v},
            }
        )
        out.append({"t": 2.0 * v + 1, "kind": "lag", "lag": {"verifier": v % 3, "trainer": 1}})
    out.append(
        {
            "t": 2.0,
            "kind": "version",
            "version": 1,
            "step": 1,
            "samples_trained": 64,
            "tokens_trained": 640,
            "broadcast_ms": 99.0,
            "servers_failed": 1,
            "reward_mean": 0.9,
        }
    )  # a re-published version
    return out


def test_summary_figures() -> None:
    s = summarize(timeline(), load_config(None), wall_s=25.0, exit_reason="done", failed=None)
    assert s["versions"] == {"count": 11, "first": 0, "last": 10, "max_steps": 1000, "first_update_s": 2.0}
    assert s["resumed_from"] is None
    assert s["reward"]["first3_mean"] == pytest.approx(0.2)  # versions 1..3, the first record of v1 wins
    assert s["reward"]["last3_mean"] == pytest.approx(0.9)
    assert s["version_lag"] == {"mean": 0.5, "max": 1, "samples_over_bound": 0}
    assert s["throughput"]["actor_records_per_s"] == pytest.approx(1000 / 20)
    assert s["throughput"]["trainer_samples_per_s"] == pytest.approx(64 * 9 / 18)
    assert s["broker_lag"]["verifier"]["max"] == 2
    assert s["weight_sync"]["broadcast_ms_max"] == 15.0


def test_plots_are_written(tmp_path: Path) -> None:
    paths = write_plots(timeline(), tmp_path)
    assert {p.name for p in paths} == {
        "reward.png",
        "version_lag.png",
        "broker_lag.png",
        "throughput.png",
        "eval.png",
        "overview.png",
    }
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def burst_timeline() -> list[dict]:  # type: ignore[type-arg]
    """A run whose records share timestamps: two versions read in one launcher tick, offsets sampled
    twice at one instant, and an eval curve."""
    out: list[dict] = [{"t": 0.0, "kind": "start", "resumed_from": None}]  # type: ignore[type-arg]
    for v in range(40):
        t = float(v // 2)  # versions 2i and 2i+1 at the same instant
        out.append(
            {
                "t": t,
                "kind": "version",
                "version": v,
                "step": v,
                "samples_trained": 128 * v,
                "tokens_trained": 1000 * v,
                "broadcast_ms": 5.0,
                "servers_failed": 0,
                **(
                    {"reward_mean": min(1.0, 0.2 + 0.02 * v), "version_lag_mean": 0.9, "version_lag_max": 1}
                    if v
                    else {}
                ),
            }
        )
    for i in range(30):
        t = float(i // 2 * 1.5)  # pairs of samples at one instant
        out.append(
            {
                "t": t,
                "kind": "offsets",
                "offsets": {"loader": 5000, "actor": 300 * i, "verifier": 290 * i, "preprocessor": 20 * i},
            }
        )
        out.append({"t": t, "kind": "lag", "lag": {"verifier": i % 5, "actor": 5000 - 30 * i}})
    for v in (0, 10, 20, 30, 39):
        out.append(
            {
                "t": v / 2,
                "kind": "eval",
                "version": v,
                "split": "held-out",
                "pass_at_1": 0.5 + v / 100,
                "k": 4,
                "sampled_pass_at_1": 0.3 + v / 100,
                "pass_at_k": 0.6 + v / 100,
                "mean_length": 3.0,
                "off_version_token_frac": 0.0,
            }
        )
    return out


def test_every_plotted_value_is_physically_possible_with_duplicate_timestamps() -> None:
    from stream_rl.observe.plots import RATE_MIN_S, panels

    timeline = burst_timeline()
    data = panels(timeline)
    assert set(data) == {"reward", "eval", "version_lag", "broker_lag", "throughput"}
    offsets = [r for r in timeline if r["kind"] == "offsets"]
    # A rate can never exceed everything the stage produced divided by the window floor, nor be
    # negative: the 1.2e11 records/s spikes came from dividing by two equal timestamps.
    totals = {
        f"{stage} out": offsets[-1]["offsets"][stage] for stage in ("actor", "verifier", "preprocessor")
    }
    totals["trainer samples"] = 128 * 39
    thr = {line.label: line for line in data["throughput"].lines}
    assert set(thr) == set(totals)
    for label, line in thr.items():
        assert line.ys, label
        assert all(0 <= y <= totals[label] / RATE_MIN_S for y in line.ys), (label, max(line.ys))
        assert len(line.xs) == len(line.ys)
    # The steady rates are the true ones: 600 records per 1.5 s for the actor, 256 samples/s trained.
    assert thr["actor out"].ys[-1] == pytest.approx(400.0)
    assert thr["trainer samples"].ys[-1] == pytest.approx(256.0)
    for line in data["reward"].lines + data["eval"].lines:
        assert all(0.0 <= y <= 1.0 for y in line.ys), line.label
    assert {line.label for line in data["eval"].lines} >= {"held-out: greedy pass@1", "held-out: pass@4"}
    for line in data["version_lag"].lines:
        assert all(0 <= y <= 1 for y in line.ys)
    for line in data["broker_lag"].lines:
        assert all(0 <= y <= 5000 for y in line.ys)


def test_windowed_rates_never_divide_by_less_than_the_floor() -> None:
    from stream_rl.observe.plots import windowed_rates

    ts, rates = windowed_rates([(0.0, 0.0), (0.0, 10.0), (1.0, 20.0), (1.0, 1e9), (5.0, 1e9 + 4)], 10.0, 4.0)
    assert ts == [5.0]
    assert rates == [pytest.approx((1e9 + 4) / 5.0)]
    assert windowed_rates([(0.0, 1.0), (0.0, 5.0)]) == ([], [])


def test_summary_line_describes_this_invocation_only_and_never_crashes_on_missing_figures() -> None:
    from stream_rl.run.launch import summary_line

    tl = [{"t": 0.0, "kind": "start", "resumed_from": 40}]
    tl += [
        {"t": float(v), "kind": "version", "version": v, "step": v, "samples_trained": v, "tokens_trained": v,
         "broadcast_ms": 1.0, "servers_failed": 0, "reward_mean": 0.5}
        for v in range(41, 101)
    ]  # fmt: skip
    s = summarize(tl, load_config(None), wall_s=60.0, exit_reason="reached max_steps (100)", failed=None)
    line = summary_line(s)
    assert "resumed at version 40: trained versions 41-100" in line and "reward 0.500 -> 0.500" in line
    empty = summarize(
        [{"t": 0.0, "kind": "start"}], load_config(None), wall_s=1.0, exit_reason="stopped", failed=None
    )
    assert summary_line(empty).endswith("no version trained by this invocation")
    assert "after -s" in summary_line({"run": "r", "exit_reason": "x", "wall_s": None})


def test_the_closing_line_names_sampled_and_greedy_eval_figures() -> None:
    """The demo's eval moved sampled pass@1 0.21 -> 0.79 and pass@4 0.57 -> 0.96 while greedy pass@1
    went 0.96 -> 0.93: the line says all three, named, sampled first (issue 34, item 7)."""
    from stream_rl.run.launch import summary_line

    first = {
        "version": 0,
        "split": "held-out",
        "pass_at_1": 0.96,
        "sampled_pass_at_1": 0.21,
        "pass_at_k": 0.57,
        "k": 4,
    }
    last = {
        "version": 100,
        "split": "held-out",
        "pass_at_1": 0.93,
        "sampled_pass_at_1": 0.79,
        "pass_at_k": 0.96,
        "k": 4,
    }
    s = {"run": "demo", "exit_reason": "reached max_steps (100)", "wall_s": 120.0,
         "versions": {"count": 100, "first": 1, "last": 100}, "reward": {"first3_mean": 0.289, "last3_mean": 0.87},
         "eval": {"first": first, "last": last}}  # fmt: skip
    assert summary_line(s).endswith(
        "reward 0.289 -> 0.870, eval on held-out (version 0 -> 100): sampled pass@1 0.210 -> 0.790, "
        "pass@4 0.570 -> 0.960, greedy pass@1 0.960 -> 0.930"
    )
    greedy_only = {"version": 5, "split": "held-out", "pass_at_1": 0.5, "k": 0}
    assert summary_line(s | {"eval": {"first": greedy_only, "last": greedy_only}}).endswith(
        "eval on held-out (version 5 -> 5): greedy pass@1 0.500 -> 0.500"
    )
