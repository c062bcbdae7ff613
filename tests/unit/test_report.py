"""Summary and plots of a run, from a synthetic timeline."""

from __future__ import annotations

from pathlib import Path

import pytest

from stream_rl.config import load_config
from stream_rl.report import summarize, write_plots

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
    assert s["versions"] == {"count": 11, "last": 10, "first_update_s": 2.0}
    assert s["reward"]["first3_mean"] == pytest.approx(0.2)  # versions 1..3, the first record of v1 wins
    assert s["reward"]["last3_mean"] == pytest.approx(0.9)
    assert s["version_lag"] == {"mean": 0.5, "max": 1}
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
        "overview.png",
    }
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
