"""What a run records for `replay trainer`, once, on the trainer's first start:

    runs/<run>/trainer/record/config.yaml   the resolved run config (secrets left out)
    runs/<run>/trainer/record/init.json     the initial weights' checksum and model path, the
                                            seed, thread count, torch/transformers versions and
                                            the code revision

Later starts (resumes) leave both as they are; the launcher's own `trainer/config.yaml` is
rewritten at every launch, so it is not the record.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from stream_rl.config import RunConfig, dump_config


def record_dir(config: RunConfig) -> Path:
    return config.run_dir / "trainer" / "record"


def recorded_config_path(runs_dir: str | Path, run: str) -> Path:
    return Path(runs_dir) / run / "trainer" / "record" / "config.yaml"


def code_revision() -> str | None:
    """The git commit of this code, when it runs from a checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def write_run_record(config: RunConfig, initial_checksum: str) -> Path:
    """Write the record unless it exists; returns its directory."""
    import torch
    import transformers

    directory = record_dir(config)
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / "config.yaml").exists():
        (directory / "config.yaml").write_text(dump_config(config))
    if not (directory / "init.json").exists():
        tcfg = config.trainer
        record = {
            "run": config.run,
            "model_path": str(Path(config.model.path).resolve()),
            "checksum": initial_checksum,
            "seed": tcfg.seed,
            "deterministic": tcfg.deterministic,
            "torch_threads": tcfg.torch_threads,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "code_revision": code_revision(),
        }
        (directory / "init.json").write_text(json.dumps(record, indent=1) + "\n")
    return directory
