"""The package installs the way a GPU user installs it: `stream-rl[gpu]` resolves from the registry
(PyPI, reached by CI) to vLLM 0.33 with its torch and transformers, and uv.lock is what
pyproject.toml resolves to (`make setup` installs the lock as it is: `uv sync --frozen`)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def uv() -> str:
    """The uv `make setup` used (PATH, else the one it installs into the cache)."""
    cached = Path(os.environ.get("CACHE", Path.home() / ".cache" / "stream-rl")) / "tools" / "bin" / "uv"
    found = shutil.which("uv") or (str(cached) if cached.exists() else None)
    if found is None:
        pytest.fail(f"uv is neither on PATH nor at {cached}: run `make setup` (it installs uv there)")
    return found


def test_the_gpu_extra_resolves_to_vllm_033_with_its_torch_and_transformers(tmp_path: Path) -> None:
    out = tmp_path / "gpu.txt"
    cmd = [uv(), "pip", "compile", "pyproject.toml", "--extra", "gpu", "--python-version", "3.11"]
    cmd += ["--python-platform", "x86_64-manylinux_2_28", "--no-header", "--quiet", "-o", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]  # a conflict: uv names both requirements
    pins = dict(
        line.split("==", 1)
        for line in out.read_text().splitlines()
        if "==" in line and not line.startswith(" ")
    )
    assert pins["vllm"] == "0.33.0"
    assert pins["torch"].startswith("2.14."), pins["torch"]
    major, minor = (int(x) for x in pins["transformers"].split(".")[:2])
    assert (major, minor) >= (5, 20) and (major, minor) < (5, 21), pins["transformers"]


def test_the_lock_is_what_pyproject_resolves_to() -> None:
    done = subprocess.run([uv(), "lock", "--check"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"uv.lock is stale: run `make lock`\n{done.stderr[-2000:]}"
