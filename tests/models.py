"""Test models, built once per code version and kept in `~/.cache/stream-rl/test-models/`.

A model is a pure function of the code that makes it (`make_model`'s presets are bit-identical per
seed; the warm start is seeded), so the cache key is a hash of that code and of the torch and
transformers versions: a change to any of them builds the model again. CI's clean clones share
the cache, like the Maven and uv caches, so the warm start (~30 s of CPU) runs once per code
change instead of once per test session. Concurrent builders each write a temporary directory
and rename it into place.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("STREAM_RL_CACHE", Path.home() / ".cache" / "stream-rl")) / "test-models"
_SOURCES = (
    "stream_rl/inference/model_maker.py",
    "stream_rl/tools/warm_start.py",
    "stream_rl/tasks/arithmetic.py",
    "stream_rl/tasks/base.py",
)


def _key(preset: str, seed: int, warm_start: str | None) -> str:
    import torch
    import transformers

    digest = hashlib.sha256(
        f"{preset}:{seed}:{warm_start}:{torch.__version__}:{transformers.__version__}".encode()
    )
    for source in _SOURCES:
        digest.update((REPO / source).read_bytes())
    return digest.hexdigest()[:16]


def cached_model(preset: str = "tiny", *, seed: int = 0, warm_start: str | None = None) -> Path:
    """The directory of a `make_model(preset, seed)` model, warm-started on `warm_start` if given."""
    from stream_rl.inference.model_maker import make_model

    name = f"{preset}-{warm_start or 'random'}-{_key(preset, seed, warm_start)}"
    target = CACHE / name
    if (target / "config.json").exists():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    scratch = CACHE / f".{name}.{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    make_model(scratch, preset, seed=seed)
    if warm_start is not None:
        from stream_rl.tools.warm_start import warm_start as fit

        fit(scratch, warm_start, seed=seed, progress=False)
    try:
        scratch.rename(target)
    except OSError:  # another session got there first
        shutil.rmtree(scratch, ignore_errors=True)
    return target
