"""A run of `bench/pipeline_vs_conventional.py` while it goes and after it: whether its reward has
reached the target (`--stop-at-target`), and the completion lengths of its scored rollouts."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from run_probe import centered_mean, versions_of


def completion_lengths(run_dir: Path, bootstrap: str) -> dict[str, Any]:
    """Sampled completion lengths (tokens) of every scored rollout of the run, read from `scored`
    (`stream-rl export rollouts`): mean, p10/p50/p90/p99, p99 / p50, and the share cut at
    max_tokens. Empty if the export failed (its error is printed)."""
    out = run_dir / "scored.parquet"
    cmd = [sys.executable, "-m", "stream_rl.cli", "export", "rollouts", "--run", run_dir.name]
    cmd += ["--runs-dir", str(run_dir.parent), "--out", str(out), "--bootstrap", bootstrap]
    done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0 or not out.exists():
        print(f"  completion lengths: export failed: {done.stderr.strip()[-300:]}", flush=True)
        return {}
    import pyarrow.parquet as pq

    table = pq.read_table(out, columns=["completion_token_ids", "finish_reason"]).to_pydict()
    lengths = sorted(len(ids) for ids in table["completion_token_ids"])
    if not lengths:
        return {}

    def q(p: float) -> int:
        return lengths[min(len(lengths) - 1, int(p * len(lengths)))]

    return {
        "n": len(lengths),
        "mean": statistics.fmean(lengths),
        **{f"p{round(p * 100)}": q(p) for p in (0.1, 0.5, 0.9, 0.99)},
        "p99_over_p50": q(0.99) / q(0.5),
        "cut_at_max_tokens": table["finish_reason"].count("length") / len(lengths),
    }


def target_reached(run_dir: Path, target: float, window: int) -> int | None:
    """The version at which the centred moving mean of the trained reward reached `target`, once
    it is final (the `window // 2` versions after it are published), else None. Read from the
    live timeline (its last line may be half written)."""
    path = run_dir / "timeline.jsonl"
    if not path.exists():
        return None
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # the line being written
    starts = [i for i, r in enumerate(records) if r.get("kind") == "start"]
    updates = versions_of(records[starts[-1] :] if starts else records)[1:]
    smooth = centered_mean([float(v.get("reward_mean", 0.0)) for v in updates], window)
    final = len(updates) - window // 2  # points whose whole window is published
    return next((updates[i]["version"] for i in range(max(final, 0)) if smooth[i] >= target), None)
