"""What a run records for `replay trainer`, once, on the trainer's first start:

    runs/<run>/trainer/record/config.yaml   the resolved run config (secrets left out), headed by
                                            a comment naming the software that trained it
    runs/<run>/trainer/record/init.json     the initial weights' checksum and model path, the
                                            seed, thread count, torch/transformers versions and
                                            the code revision

Later starts (resumes) leave both as they are; the launcher's own `trainer/config.yaml` is
rewritten at every launch, so it is not the record. `replay trainer` compares the recorded
torch and transformers with its own and warns in one line when they differ (`version_drift`):
bit-exact checksums need the same kernels.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from stream_rl.config import RunConfig, dump_config

PINNED = ("torch", "transformers")
"""The libraries whose exact versions the checksums depend on (their kernels)."""


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


def software(engine: str | None = None, engine_version: str | None = None) -> dict[str, str | None]:
    """The versions this process runs: Python, stream-rl (and its code revision), torch,
    transformers (read from the installed distributions, without importing them), and the
    inference engine when given (`builtin`, or vLLM's / SGLang's release)."""
    import platform
    from importlib import metadata

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    out: dict[str, str | None] = {
        "python": platform.python_version(),
        "stream_rl": version("stream-rl"),
        "code_revision": code_revision(),
        **{name: version(name) for name in PINNED},
    }
    if engine is not None:
        out["engine"] = engine_label(engine, engine_version)
    return out


def engine_label(engine: str, version: str | None = None) -> str:
    """`builtin`, or the engine and its release (`vllm 0.32.0`; `?` while not probed)."""
    return engine if engine == "builtin" else f"{engine} {version or '?'}"


def software_header(versions: dict[str, str | None]) -> str:
    """A YAML comment naming `versions`, to head a config copy (a comment: the file still loads)."""
    shown = ", ".join(f"{k} {v}" for k, v in versions.items() if v is not None)
    return f"# written by: {shown}\n"


def version_drift(recorded: dict[str, object]) -> str | None:
    """One line if this process's torch or transformers differ from `recorded` (a run's
    init.json), else None."""
    import torch
    import transformers

    now = {"torch": torch.__version__, "transformers": transformers.__version__}
    differ = [
        f"{k} {recorded[k]} (now {now[k]})" for k in PINNED if recorded.get(k) and recorded[k] != now[k]
    ]
    if not differ:
        return None
    return (
        f"the run was trained with {', '.join(differ)}: checksums may differ for that alone "
        "(bit-exact replay needs the recorded versions)"
    )


def write_run_record(config: RunConfig, initial_checksum: str) -> Path:
    """Write the record unless it exists; returns its directory."""
    import torch
    import transformers

    directory = record_dir(config)
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / "config.yaml").exists():
        (directory / "config.yaml").write_text(software_header(software()) + dump_config(config))
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
