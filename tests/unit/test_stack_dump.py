"""A stuck stage says where it is stuck: every `stream-rl` command prints its threads' stacks on
SIGUSR1 and goes on (the launcher asks for them before it kills a stage as stuck), a real process."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stream_rl.cli import STACKS_SIGNAL
from stream_rl.config import load_config
from stream_rl.run.children import Child
from stream_rl.run.supervision import Supervision
from stream_rl.run.watchdog import Sample, Watchdog

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def _catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for `signum` (its /proc status's SigCgt mask)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def _blocked_stage(tmp_path: Path, role: str) -> Child:
    """A real `stream-rl loader` blocked in its broker wait (a port nothing listens on), with its
    stack-dump handler installed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    tmp_path.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "stream_rl.cli", "loader", "--config", "configs/demo-cpu.yaml"]
    child = Child(f"{role}-0", role, [*cmd, "--bootstrap", f"127.0.0.1:{closed}"], tmp_path)
    assert child.dumps_stacks
    with open(child.log, "wb") as log:
        child.proc = subprocess.Popen(
            child.cmd,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={"PATH": "/usr/bin:/bin", "STREAM_RL_KAFKA_REACHABLE_WAIT_S": "60"},
        )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (
        _catches(child.proc.pid, STACKS_SIGNAL) and _catches(child.proc.pid, signal.SIGTERM)
    ):
        time.sleep(0.05)
    time.sleep(1.0)  # into the broker wait
    return child


def test_a_stage_blocked_in_a_call_prints_its_stacks_and_goes_on(tmp_path: Path) -> None:
    child = _blocked_stage(tmp_path, "loader")
    assert child.proc is not None
    try:
        assert child.dump_stacks()
        text = child.log.read_text()
        assert "Current thread" in text or "Thread 0x" in text, text[-2000:]
        assert 'File "' in text and "stream_rl/cli.py" in text, text[-2000:]
        assert child.proc.poll() is None, "the dump does not stop the process"
    finally:
        child.proc.kill()
        child.proc.wait()
    assert not child.dump_stacks(), "a dead child is not asked"


def test_the_launcher_asks_a_stuck_stage_for_its_stacks_before_it_kills_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sup = Supervision()
    sup.config = load_config(REPO / "configs" / "demo-cpu.yaml", ["launcher.restart=true"])
    child = _blocked_stage(tmp_path / "actor", "actor")
    other = _blocked_stage(tmp_path / "preprocessor", "preprocessor")
    sup.children = [child, other]
    watchdog = Watchdog(timeout_s=10)
    watchdog.observe(0.0, Sample(version=3, outputs={"loader": 40}, lags={"actor": 8}))
    watchdog.observe(6.0, Sample(version=3, outputs={"loader": 40}, lags={"actor": 8}))
    try:
        assert sup.handle_stall(watchdog)  # restarted, not stopped
        assert child.proc is not None and child.proc.poll() is not None, "killed"
        assert other.proc is not None and other.proc.poll() is None, "a stage not blamed goes on"
    finally:
        for c in (child, other):
            assert c.proc is not None
            c.proc.kill()
            c.proc.wait()
    err = capsys.readouterr().err
    assert "stuck: actor" in err and f"its threads' stacks are at the end of {child.log}" in err, err
    assert "(most recent call first):" in child.log.read_text()
    # The stages not blamed: their stacks too, each in its own log, and named.
    assert "the stacks of preprocessor-0 are at the end of their logs" in err, err
    assert "(most recent call first):" in other.log.read_text()


def test_a_stage_that_does_not_stop_on_sigterm_is_asked_then_killed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    child = _blocked_stage(tmp_path, "verifier")  # its SIGTERM flag waits for the broker wait
    assert child.proc is not None
    try:
        child.proc.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            child.proc.wait(1.0)
        assert child.kill_ignoring_sigterm(1.0) == -signal.SIGKILL
    finally:
        child.proc.kill()
        child.proc.wait()
    err = capsys.readouterr().err
    assert (
        f"verifier-0 did not stop within 1s of SIGTERM: killing it (its threads' stacks: end of {child.log})"
        in err
    )
    assert "(most recent call first):" in child.log.read_text()


def test_only_stream_rl_commands_are_asked(tmp_path: Path) -> None:
    vllm = Child("server-0", "server", [sys.executable, "-m", "vllm.entrypoints.openai.api_server"], tmp_path)
    assert not vllm.dumps_stacks
