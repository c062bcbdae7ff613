"""The autoscaler's state as `stream-rl status` shows it: `runs/<run>/autoscale.json`, written by the
launcher's `launcher.autoscale` (`stream_rl/run/autoscale.py`) at each signal sample."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

STATE = "autoscale.json"
"""`runs/<run>/autoscale.json`: replicas, bounds, the last signals and decisions."""


def read_state(run_dir: Path) -> dict[str, Any] | None:
    """`runs/<run>/autoscale.json` (None: the run does not autoscale, or not yet)."""
    try:
        data = json.loads((run_dir / STATE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def status_lines(state: dict[str, Any]) -> list[str]:
    """The autoscale section of `stream-rl status`."""
    reps, bounds = state.get("replicas") or {}, state.get("bounds") or {}
    parts = [
        f"{role} {reps.get(role, '?')} ({b.get('min')}-{b.get('max')})" for role, b in sorted(bounds.items())
    ]
    sig = state.get("signals") or {}

    def f(x: Any) -> str:
        return "-" if x is None else f"{x:.2f}"

    lines = [
        f"autoscale: {', '.join(parts)}; cool-down {state.get('cooldown_s', 0):.0f} s; server occupancy "
        f"{f(sig.get('occupancy'))}, trainer busy {f(sig.get('trainer_busy'))}, version lag {f(sig.get('version_lag'))}"
    ]
    for d in (state.get("decisions") or [])[-5:]:
        when = time.strftime("%H:%M:%S", time.localtime(d.get("wall_time", 0)))
        err = f" (not applied: {d['error']})" if d.get("error") else ""
        lines.append(
            f"  {when} {d['role']} {d['before']} -> {d['after']} [{d['signal']}]: {d['reason']}{err}"
        )
    return lines
