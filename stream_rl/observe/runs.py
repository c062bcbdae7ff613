"""`stream-rl runs [--runs-dir runs]`: the runs of a runs directory, one line each.

State, from the run directory alone (no broker needed): `running` (its launcher is alive),
`finished` (the last invocation reached `trainer.max_steps`), `stopped (<why>)`, `failed
(<child>)`, `never finished` (launched, no summary yet: killed, or still starting), or `not
started` (a directory `replay preprocessor` or `rescore` wrote). Versions
are the last one trained and `trainer.max_steps`; reward and eval are the last invocation's
(`summary.json`); `where` is the run directory.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

from stream_rl.kafka.broker import pid_alive


def _fmt(x: Any, spec: str = ".3f") -> str:
    return format(x, spec) if isinstance(x, int | float) else "-"


def describe(run_dir: Path) -> dict[str, str]:
    """One row of `stream-rl runs` for `run_dir`."""
    summary: dict[str, Any] = {}
    if (run_dir / "summary.json").is_file():
        summary = json.loads((run_dir / "summary.json").read_text())
    procs: dict[str, Any] = {}
    if (run_dir / "processes.json").is_file():
        procs = json.loads((run_dir / "processes.json").read_text())
    config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    max_steps = (config.get("trainer") or {}).get("max_steps", "?")
    launcher = procs.get("launcher_pid")
    started_after_summary = (run_dir / "processes.json").is_file() and (
        not summary
        or (run_dir / "processes.json").stat().st_mtime > (run_dir / "summary.json").stat().st_mtime
    )
    if isinstance(launcher, int) and pid_alive(launcher) and started_after_summary:
        state = "running"
    elif not summary and not procs:
        state = "not started"  # e.g. written by `replay preprocessor` or `rescore`
    elif not summary or started_after_summary:
        state = "never finished"
    elif summary.get("failed"):
        state = f"failed ({summary['failed']})"
    elif str(summary.get("exit_reason", "")).startswith("reached max_steps"):
        state = "finished"
    else:
        state = f"stopped ({summary.get('exit_reason')})"
    versions = summary.get("versions") or {}
    reward = summary.get("reward") or {}
    last_eval = (summary.get("eval") or {}).get("last") or {}
    return {
        "run": run_dir.name,
        "state": state,
        "versions": f"{versions.get('last', '-') if versions.get('last') is not None else '-'}/{max_steps}",
        "reward": f"{_fmt(reward.get('first3_mean'))} -> {_fmt(reward.get('last3_mean'))}",
        "eval pass@1 sampled/greedy": f"{_fmt(last_eval.get('sampled_pass_at_1'))}/{_fmt(last_eval.get('pass_at_1'))}"
        + (f" (v{last_eval['version']})" if last_eval else ""),
        "where": str(run_dir),
    }


def list_runs(runs_dir: Path) -> list[dict[str, str]]:
    if not runs_dir.is_dir():
        return []
    return [describe(d) for d in sorted(runs_dir.iterdir()) if (d / "config.yaml").is_file()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs-dir", default="runs", help="where runs live (default runs/)")


def main(args: argparse.Namespace) -> int:
    from stream_rl.observe.status import table

    rows = list_runs(Path(args.runs_dir))
    if not rows:
        print(f"no runs in {args.runs_dir}/ (start one with `stream-rl run CONFIG`)")
        return 0
    print(table([tuple(rows[0])] + [tuple(r.values()) for r in rows]))
    return 0
