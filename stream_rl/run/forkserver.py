"""The launcher's fork server: its `stream-rl` stages forked from one process that has already
imported what they import (torch, transformers, the run's model class, the stage modules), instead
of each importing it again. On CPU that import is most of what a short-lived stage costs: ~6.5 s of
CPU for a trainer or a built-in server on 2 cores, out of ~7 for a whole 4-step run (README
"Starting stages"); a restarted stage is back in well under a second.

The launcher starts it (`ForkServer.start`) when `launcher.fork_stages` is `auto` and the run is on
CPU; it never touches CUDA (a process that has initialised CUDA cannot fork a usable child), and a
GPU run starts its stages as separate programs, as before. Engines that are other programs (vLLM,
SGLang) are always started as such.

Protocol, over a Unix `SOCK_SEQPACKET` socket pair (one JSON object per message):
- launcher -> server: `{"argv": [...], "title": "...", "env": {...}, "cwd": "..."}` with two file
  descriptors (the child's stdin and its log, for stdout and stderr) attached (`SCM_RIGHTS`);
  `argv` is what follows `python -m stream_rl.cli`, `title` the command line `ps` shows for it.
- server -> launcher: `{"started": pid}` (or `{"error": "..."}`) in answer, and `{"exited": pid,
  "code": n}` when a child ends (`n < 0`: killed by signal `-n`, as `subprocess` reports it).
The launcher's `ForkedProcess` gives each child the `subprocess.Popen` surface supervision uses
(`pid`, `poll`, `wait`, `send_signal`, `kill`, `returncode`). Each child is the server's child, so
it gets SIGTERM when the server dies (`PR_SET_PDEATHSIG`), and the server when the launcher dies.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PRELOAD = [
    "torch",
    "torch._inductor.config",  # torch.use_deterministic_algorithms imports it (~1.2 s of CPU)
    "transformers",
    "stream_rl.stages.trainer",
    "stream_rl.stages.actor",
    "stream_rl.stages.verifier",
    "stream_rl.stages.preprocessor",
    "stream_rl.stages.loader",
    "stream_rl.stages.evaluator",
    "stream_rl.inference.server",
    "stream_rl.tools.track",
]
"""What the server imports before it forks anything (`stream_rl.cli` imports each command's module
lazily; these are the launcher's stages')."""

MAX_MESSAGE = 1 << 20


def available() -> bool:
    """Linux with `pidfd_open` (kernel 5.3+) and `socket.send_fds`: else stages start as programs."""
    return sys.platform == "linux" and hasattr(os, "pidfd_open") and hasattr(socket, "send_fds")


_setproctitle: Callable[[str], None] | None = None


def _preload(modules: list[str], model_path: str | None) -> None:
    global _setproctitle
    with contextlib.suppress(ImportError):  # a dependency; this only guards odd installs
        # Imported while the server's environment is intact: it extends the command line's memory
        # over the environment's, which it copies first.
        from setproctitle import setproctitle

        _setproctitle = setproctitle
    for name in modules:
        importlib.import_module(name)
    if model_path is None:
        return
    # The model's class and tokenizer classes: transformers imports them on first use (its
    # modeling module imports torch._dynamo: ~1.5 s of CPU more per stage otherwise).
    import transformers

    with contextlib.suppress(Exception):  # a stage whose class this misses imports it itself
        config = json.loads((Path(model_path) / "config.json").read_text())
        for arch in config.get("architectures") or []:
            getattr(transformers, arch, None)
        getattr(transformers, "PreTrainedTokenizerFast", None)


def _set_pdeathsig(sig: int) -> None:
    import ctypes

    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # 1 = PR_SET_PDEATHSIG


def _run_child(
    server_pid: int, argv: list[str], title: str, env: dict[str, str], cwd: str, stdin: int, log: int
) -> int:
    """In the forked child: become `python -m stream_rl.cli *argv` and return its exit code."""
    import random

    # Default dispositions before the death signal is armed: one ignored (inherited through the
    # launcher's exec) would swallow it.
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _set_pdeathsig(signal.SIGTERM)  # the server dying (it dies with the launcher) ends us
    if os.getppid() != server_pid:  # it died before the line above: as if after it
        os.kill(os.getpid(), signal.SIGTERM)
    if _setproctitle is not None:  # before the environment changes: it reuses its memory
        _setproctitle(title)  # ps and top show the stage's command, not ours
    os.dup2(stdin, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(stdin)
    os.close(log)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    random.seed()  # the server's RNG states would otherwise be every child's
    with contextlib.suppress(ImportError):
        import numpy as np

        np.random.seed()
    sys.argv = ["stream-rl", *argv]
    from stream_rl import cli

    try:
        return cli.main(argv)
    except SystemExit as exc:
        code = exc.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1


def _fork(sock: socket.socket, others: list[int], request: dict[str, Any], fds: list[int]) -> int:
    stdin, log = fds
    server_pid = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        sock.close()
        for fd in others:
            os.close(fd)
        code = _run_child(
            server_pid, request["argv"], request["title"], request["env"], request["cwd"], stdin, log
        )
    except BaseException:  # noqa: BLE001 - the child's own traceback, into its log
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code & 0xFF if code >= 0 else 1)
    raise AssertionError("unreachable")


def serve(fd: int, modules: list[str], model_path: str | None) -> None:
    """The server's loop: fork on each request, report each child's end; returns (ending the
    server, and so, through their death signal, any children left) when the launcher's end closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    # SIGTERM ends the server even where the launcher was started with it ignored (an ignored
    # signal survives exec): its death signal below must not be swallowed.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _set_pdeathsig(signal.SIGTERM)
    sock = socket.socket(fileno=fd)
    _preload(modules, model_path)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ, None)
    children: dict[int, int] = {}  # pidfd -> pid
    while True:
        for key, _ in sel.select():
            if key.data is None:
                msg, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 2)
                if not msg:
                    return
                try:
                    pid = _fork(sock, [sel.fileno(), *children], json.loads(msg), fds)
                    pidfd = os.pidfd_open(pid)
                except (OSError, ValueError, KeyError) as exc:
                    sock.send(json.dumps({"error": str(exc)}).encode())
                    continue
                finally:
                    for f in fds:
                        os.close(f)
                children[pidfd] = pid
                sel.register(pidfd, selectors.EVENT_READ, pid)
                sock.send(json.dumps({"started": pid}).encode())
            else:
                pid = key.data
                sel.unregister(key.fd)
                os.close(key.fd)
                del children[key.fd]
                _, status = os.waitpid(pid, 0)
                code = os.waitstatus_to_exitcode(status)
                sock.send(json.dumps({"exited": pid, "code": code}).encode())


class ForkServer:
    """The launcher's end: start the server, fork children through it (`spawn`), and track their
    exits (a reader thread)."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.proc = proc
        self._sock = sock
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._answers: list[dict[str, Any]] = []
        self._codes: dict[int, int] = {}
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="forkserver-reader", daemon=True)
        self._reader.start()

    @classmethod
    def start(
        cls, env: dict[str, str], log: Path, model_path: str | None, preload: list[str] = PRELOAD
    ) -> ForkServer:
        """Start the server with `env`, its output appended to `log`; it imports `preload` and the
        classes of the model in `model_path` before it forks anything."""
        from stream_rl.run.children import die_with_parent

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cmd = [sys.executable, "-m", "stream_rl.run.forkserver", str(theirs.fileno()), ",".join(preload)]
        if model_path is not None:
            cmd.append(model_path)
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                pass_fds=[theirs.fileno()],
                preexec_fn=die_with_parent,
            )
        theirs.close()
        return cls(proc, ours)

    def _read(self) -> None:
        while True:
            try:
                msg = self._sock.recv(MAX_MESSAGE)
            except OSError:
                msg = b""
            with self._changed:
                if not msg:
                    self._closed = True
                    self._changed.notify_all()
                    return
                data = json.loads(msg)
                if "exited" in data:
                    self._codes[int(data["exited"])] = int(data["code"])
                else:
                    self._answers.append(data)
                self._changed.notify_all()

    def spawn(self, cmd: list[str], env: dict[str, str], log: Path, timeout_s: float = 30.0) -> ForkedProcess:
        """Fork `cmd` (`[sys.executable, "-m", "stream_rl.cli", *argv]`) with `env`, stdout and
        stderr appended to `log`. Raises OSError when the server cannot (the caller then starts the
        child as a program)."""
        request = {"argv": cmd[3:], "title": " ".join(cmd), "env": env, "cwd": os.getcwd()}
        with open(os.devnull, "rb") as stdin, open(log, "ab") as out, self._changed:
            if self._closed:
                raise OSError("the fork server has ended")
            try:
                socket.send_fds(self._sock, [json.dumps(request).encode()], [stdin.fileno(), out.fileno()])
            except ConnectionError as exc:  # it died before the reader saw its end
                raise OSError("the fork server has ended") from exc
            deadline = time.monotonic() + timeout_s
            while not self._answers:
                left = deadline - time.monotonic()
                if self._closed or left <= 0:
                    raise OSError("the fork server did not answer")
                self._changed.wait(left)
            answer = self._answers.pop(0)
        if "error" in answer:
            raise OSError(f"the fork server could not fork: {answer['error']}")
        return ForkedProcess(self, int(answer["started"]))

    def code_of(self, pid: int, timeout: float | None) -> int | None:
        """`pid`'s exit code once the server reports it, waiting up to `timeout` (None: forever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while pid not in self._codes:
                if self._closed and not _alive(pid):
                    # The server is gone, and its children with it (their death signal): nobody
                    # can report this child's exit code any more.
                    return -signal.SIGTERM
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._changed.wait(0.5 if left is None else min(left, 0.5))
            return self._codes[pid]

    def close(self, timeout_s: float = 10.0) -> None:
        """End the server, at once (its children left, if any, get SIGTERM by their death signal)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie nobody has reaped yet does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


class ForkedProcess:
    """A child forked by the fork server, with the `subprocess.Popen` surface supervision uses."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.code_of(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.server.code_of(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"stream-rl (pid {self.pid})", timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


if __name__ == "__main__":
    serve(
        int(sys.argv[1]), [m for m in sys.argv[2].split(",") if m], sys.argv[3] if len(sys.argv) > 3 else None
    )
