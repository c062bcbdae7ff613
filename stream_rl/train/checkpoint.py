"""Atomic trainer checkpoints and resume.

Layout under the checkpoint directory (default `runs/<run>/trainer/checkpoints/`):

    step-000012/            one checkpoint (written as `.tmp-step-000012-<pid>/`, fsynced, renamed)
      model/                HF `save_pretrained` (safetensors) of the trained weights
      optimizer.pt          AdamW state_dict (torch backend; DeepSpeed: `deepspeed/`, its own
      scheduler.pt          LambdaLR state_dict   layout, optimizer partitions per rank)
      rng.pt                torch CPU (and CUDA) RNG states; rng.json: python and numpy states
      state.json            version, step, counters, consumed offsets, checksum
    latest                  the name of the newest durable checkpoint (replaced atomically)

A checkpoint exists once its directory is renamed into place and `latest` names it; a crash
before that leaves only a `.tmp-*` directory, removed by the next save. The trainer commits its
consumer offsets only after `save_checkpoint` returns. The `keep` newest checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from stream_rl.config import RunConfig
from stream_rl.errors import StreamRLError
from stream_rl.kafka.transport import TopicPartition

LATEST = "latest"


class CheckpointError(StreamRLError):
    """A checkpoint could not be written or read."""


@dataclass
class TrainerState:
    """Counters of the trainer at a version; `offsets` are the next offsets to consume."""

    version: int = 0
    step: int = 0
    samples_trained: int = 0
    tokens_trained: int = 0
    samples_filtered: int = 0
    offsets: dict[TopicPartition, int] = field(default_factory=dict)
    checksum: str = ""
    consumed_by_partition: dict[int, int] = field(default_factory=dict)
    """Samples consumed by problems partition (`WeightVersion.consumed_by_partition`); empty in a
    checkpoint written before it existed (then admission keeps its group-wide rule)."""

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["offsets"] = [{"topic": t, "partition": p, "offset": o} for (t, p), o in self.offsets.items()]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TrainerState:
        offsets = {(o["topic"], int(o["partition"])): int(o["offset"]) for o in d.get("offsets", [])}
        by = {int(p): int(n) for p, n in (d.get("consumed_by_partition") or {}).items()}
        return cls(**{**d, "offsets": offsets, "consumed_by_partition": by})


def checkpoint_root(config: RunConfig) -> Path:
    """`trainer.checkpoint_dir`, default `runs/<run>/trainer/checkpoints`."""
    ckpt = config.trainer.checkpoint_dir
    return Path(ckpt) if ckpt else config.run_dir / "trainer" / "checkpoints"


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with open(Path(dirpath) / name, "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(Path(dirpath))


def _rng_json() -> dict[str, Any]:
    import numpy as np

    np_state: Any = np.random.get_state()
    kind, keys, pos, has_gauss, gauss = np_state
    version, internal, gauss_py = random.getstate()
    return {
        "python": [version, list(internal), gauss_py],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
    }


def _set_rng_json(d: dict[str, Any]) -> None:
    import numpy as np

    version, internal, gauss_py = d["python"]
    random.setstate((version, tuple(internal), gauss_py))
    kind, keys, pos, has_gauss, gauss = d["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


def save_checkpoint(root: Path, write: Callable[[Path], None], state: TrainerState, keep: int = 2) -> Path:
    """Write a checkpoint of `state.step` atomically and point `latest` at it; returns its path.

    `write(directory)` writes the backend's files (model, optimizer, scheduler) into the
    temporary directory; this function adds the RNG states and `state.json`, then publishes it.
    """
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    name = step_name(state.step)
    tmp = root / f".tmp-{name}-{os.getpid()}"
    final = root / name
    try:
        tmp.mkdir()
        write(tmp)
        rng: dict[str, Any] = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        torch.save(rng, tmp / "rng.pt")
        (tmp / "rng.json").write_text(json.dumps(_rng_json()))
        (tmp / "state.json").write_text(json.dumps(state.to_json(), indent=1))
        _fsync_tree(tmp)
        if final.exists():  # a re-run of the same step (after a restart): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        pointer = root / f".tmp-{LATEST}-{os.getpid()}"
        pointer.write_text(name + "\n")
        with open(pointer, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(pointer, root / LATEST)
        _fsync_dir(root)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {final}: {exc}") from exc
    _prune(root, keep, current=name)
    return final


def _prune(root: Path, keep: int, current: str) -> None:
    steps = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in steps[:-keep]:
        if old.name != current:
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint `latest` names, or None when there is none."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    if not (path / "state.json").is_file():
        raise CheckpointError(f"{pointer} names {path.name}, which is missing or incomplete")
    return path


def read_state(path: Path) -> TrainerState:
    try:
        return TrainerState.from_json(json.loads((path / "state.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"cannot read {path / 'state.json'}: {exc}") from exc


def restore_rng(path: Path) -> None:
    """Restore the RNG states saved in a checkpoint."""
    try:
        rng = torch.load(path / "rng.pt", weights_only=True)
        rng_json = json.loads((path / "rng.json").read_text())
    except (OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    _set_rng_json(rng_json)
