"""The launcher's fork server (stream_rl/run/forkserver.py), real processes: a forked `stream-rl`
command gets its own argv, environment, working directory and log; the launcher's end sees its
real pid (signals, SIGSTOP included, reach the stage itself) and its exit code as `subprocess`
reports it; children die with the server; supervision starts a child as a program when the server
cannot fork it. The server preloads nothing here (the launcher's preloads torch): the same code
paths, without ~6 s of imports per test."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stream_rl.config import load_config
from stream_rl.run import forkserver
from stream_rl.run.children import Child
from stream_rl.run.supervision import Supervision

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not forkserver.available(), reason="the fork server needs Linux's pidfd_open"),
]

REPO = Path(__file__).resolve().parents[2]
WAIT_ENV = "STREAM_RL_KAFKA_REACHABLE_WAIT_S"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _lag_cmd() -> list[str]:
    """A real stage-like command that waits for a broker nothing serves (for $WAIT_ENV seconds),
    then exits 2 saying how long it waited."""
    return [
        sys.executable,
        "-m",
        "stream_rl.cli",
        "lag",
        "--run",
        "x",
        "--bootstrap",
        f"127.0.0.1:{_closed_port()}",
    ]


@pytest.fixture
def server(tmp_path: Path):  # type: ignore[no-untyped-def]
    env = {"PATH": os.environ["PATH"], "PYTHONUNBUFFERED": "1"}
    srv = forkserver.ForkServer.start(env, tmp_path / "forkserver.log", None, preload=[])
    yield srv
    srv.close()


def _state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def _catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler installed for `sig` (the SigCgt mask in its status)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught >> (sig - 1) & 1)


def _until(check, timeout_s: float = 15.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def test_a_forked_command_runs_with_its_env_and_log_and_its_exit_code_is_reported(
    server: forkserver.ForkServer, tmp_path: Path
) -> None:
    log = tmp_path / "child.log"
    log.write_text("earlier\n")
    env = {"PATH": os.environ["PATH"], "PYTHONUNBUFFERED": "1", WAIT_ENV: "1"}
    proc = server.spawn(_lag_cmd(), env, log)
    assert proc.wait(30) == 2  # the command's own exit code for "no broker"
    text = log.read_text()
    assert text.startswith("earlier\n"), "appended to, not truncated"
    assert "no Kafka broker answers" in text and "(waited 1s)" in text, text
    # A mistake in the child's own environment: its traceback lands in its log, exit code 1.
    proc = server.spawn(_lag_cmd(), {**env, "STREAM_RL_LOG_LEVEL": "bogus"}, log)
    assert proc.wait(30) == 1
    assert "Unknown level: 'BOGUS'" in log.read_text()


def test_the_launcher_signals_the_stage_itself_and_sees_how_it_died(
    server: forkserver.ForkServer, tmp_path: Path
) -> None:
    env = {"PATH": os.environ["PATH"], "PYTHONUNBUFFERED": "1", WAIT_ENV: "60"}
    cmd = _lag_cmd()
    proc = server.spawn(cmd, env, tmp_path / "stdout.log")
    try:
        assert proc.poll() is None
        title = " ".join(cmd).encode()
        assert _until(lambda: Path(f"/proc/{proc.pid}/cmdline").read_bytes().rstrip(b"\0") == title), (
            "ps shows the stage's own command line"
        )
        assert Path(f"/proc/{proc.pid}/cwd").resolve() == Path.cwd().resolve()
        child = Child("verifier-0", "verifier", cmd, tmp_path, proc=proc)
        assert child.dumps_stacks
        # The stack-dump handler installed (cli.main, before the broker wait): a SIGUSR1 earlier
        # would end the stage (the fork server resets it to the default action).
        assert _until(lambda: _catches(proc.pid, signal.SIGUSR1)), "the stage catches SIGUSR1"
        assert child.dump_stacks()
        assert "(most recent call first):" in child.log.read_text()
        os.kill(proc.pid, signal.SIGSTOP)  # the chaos test pauses an actor this way
        assert _until(lambda: _state(proc.pid) == "T")
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.5)
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        assert proc.wait(10) == -signal.SIGKILL
        assert proc.poll() == -signal.SIGKILL and proc.returncode == -signal.SIGKILL
    finally:
        proc.kill()


@pytest.mark.parametrize("launcher_ignores_sigterm", [False, True])
def test_children_die_with_the_server(tmp_path: Path, launcher_ignores_sigterm: bool) -> None:
    env = {"PATH": os.environ["PATH"], "PYTHONUNBUFFERED": "1", WAIT_ENV: "60"}
    # An ignored SIGTERM survives exec: the server and its children must not inherit it (it would
    # swallow their death signal; a unit test that leaked one into its xdist worker showed it).
    saved = signal.signal(signal.SIGTERM, signal.SIG_IGN if launcher_ignores_sigterm else signal.SIG_DFL)
    try:
        server = forkserver.ForkServer.start(env, tmp_path / "forkserver.log", None, preload=[])
    finally:
        signal.signal(signal.SIGTERM, saved)
    proc = server.spawn(_lag_cmd(), env, tmp_path / "child.log")
    assert proc.poll() is None
    server.proc.kill()  # a launcher's death reaches the server the same way (its death signal)
    assert proc.wait(15) == -signal.SIGTERM
    assert not Path(f"/proc/{proc.pid}").exists() or _state(proc.pid) == "Z", "ended (a zombie of init's)"
    with pytest.raises(OSError, match="ended"):
        server.spawn(_lag_cmd(), env, tmp_path / "child.log")
    server.close()


def test_supervision_starts_a_child_as_a_program_when_the_server_cannot_fork_it(
    server: forkserver.ForkServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sup = Supervision()
    sup.config = load_config(REPO / "configs" / "demo-cpu.yaml", [])
    sup.admin_token = None
    sup.api_key = None
    sup._launcher_port = None
    sup.server_startup_s = 30.0
    sup._fork_server = server
    child = Child("verifier-0", "verifier", _lag_cmd(), tmp_path)
    sup.spawn(child)  # forked
    assert isinstance(child.proc, forkserver.ForkedProcess)
    child.proc.kill()
    assert child.proc.wait(10) == -signal.SIGKILL
    server.proc.kill()
    server.proc.wait()
    # At once: its reader thread may not have seen the end yet (then the request meets a closed
    # socket); either way the same message.
    sup.spawn(child)  # the restart: as a program, and the server is let go
    try:
        assert isinstance(child.proc, subprocess.Popen), child.proc
        assert sup._fork_server is None
        assert "the fork server has ended: verifier-0 and the children after it start as programs" in (
            capsys.readouterr().err
        )
    finally:
        child.proc.kill()
        child.proc.wait()
