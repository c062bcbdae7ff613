"""Shared pieces of the CUDA tests of the built-in engine (tests/gpu/test_cuda_*.py).

- `TimedEngine`: the real engine, recording the wall-clock end of every step (decode gaps).
- `Worker`: `push_worker.py` in its own process (the trainer), always killed at the end.
- `record(name, value)`: figures for `bench/gpu_check.py`'s results file, appended as JSON lines
  to `$STREAM_RL_GPU_FIGURES` when set.
- `transports()`: the weight transports this machine can run, with the reason for those it
  cannot (NCCL needs the trainer and the server on two GPUs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from stream_rl.inference.engine import Engine

WORKER = Path(__file__).parent / "push_worker.py"
DEVICE = os.environ.get("STREAM_RL_GPU_TEST_DEVICE", "cuda")
"""`cpu` dry-runs the gloo cases of these tests on a CPU machine (a check of the tests themselves,
not of CUDA): `STREAM_RL_GPU_TEST_DEVICE=cpu pytest -m gpu tests/gpu -k gloo`."""
REPO = Path(__file__).resolve().parents[2]


def cuda_or_skip() -> None:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def transport_params() -> list[Any]:
    """gloo and cuda_ipc on any GPU machine; nccl only with two GPUs (skipped with the reason)."""
    two = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    nccl_skip = pytest.mark.skipif(
        not two, reason="NCCL needs trainer and server on two GPUs (it refuses two ranks on one GPU)"
    )
    return ["gloo", "cuda_ipc", pytest.param("nccl", marks=nccl_skip)]


def record(name: str, value: Any) -> None:
    path = os.environ.get("STREAM_RL_GPU_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"name": name, "value": value}) + "\n")


class TimedEngine(Engine):
    """The engine, with `step_times`: `time.time()` at the end of every step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step_times: list[float] = []

    def step(self) -> None:
        super().step()
        if self.batch.running:
            self.step_times.append(time.time())


def longest_gap(times: list[float], start: float, end: float) -> tuple[float, int]:
    """(longest gap in ms between consecutive steps overlapping [start, end], steps inside it)."""
    inside = [t for t in times if start <= t <= end]
    around = [t for t in times if t < start][-1:] + inside + [t for t in times if t > end][:1]
    gaps = [b - a for a, b in zip(around, around[1:], strict=False)]
    return (max(gaps) * 1000.0 if gaps else float("inf")), len(inside)


class Worker:
    """push_worker.py as a child process (its own session), its JSON lines collected as they come."""

    def __init__(self, *args: str, gpu: int | None = None) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.parsed: list[dict[str, Any]] = []
        self._err: list[str] = []
        self._got = threading.Condition()
        self._readers = [
            threading.Thread(target=self._read_out, daemon=True),
            threading.Thread(target=lambda: self._err.extend(self.proc.stderr or []), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read_out(self) -> None:
        for line in self.proc.stdout or []:
            if line.startswith("{"):
                with self._got:
                    self.parsed.append(json.loads(line))
                    self._got.notify_all()

    def wait_for(self, key: str, timeout: float = 120.0) -> dict[str, Any]:
        """The first line holding `key` (raises if the worker ends or the time runs out first)."""
        deadline = time.monotonic() + timeout
        with self._got:
            while True:
                for line in self.parsed:
                    if key in line:
                        return line
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"push_worker never said {key!r}: {''.join(self._err)[-3000:]}")
                self._got.wait(0.2)

    def lines(self, timeout: float = 120.0) -> tuple[int, list[dict[str, Any]], str]:
        """Wait for the worker to end: (exit code, its JSON lines, the end of its stderr)."""
        try:
            self.proc.wait(timeout=timeout)
        finally:
            self.kill()
        for reader in self._readers:
            reader.join(timeout=10)
        return self.proc.returncode, list(self.parsed), "".join(self._err)[-3000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
