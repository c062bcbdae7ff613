"""The launcher's child processes: `Child` (its command, directory, log and process), the
environment every child starts with (`child_env`: the run's admin token and API key) and
`die_with_parent`."""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from stream_rl.cli import STACKS_SIGNAL
from stream_rl.config import ADMIN_TOKEN_ENV, RunConfig
from stream_rl.config.inference import API_KEY_ENV
from stream_rl.kafka.outage import REACHABLE_WAIT_ENV

MALLOC_ARENA_MAX = "2"
"""glibc's arenas for a child, unless the launcher's environment sets its own (the broker has the
same default, `stream_rl.kafka.broker`). glibc gives threads arenas of their own (up to 8 per core)
and keeps the memory freed in them; the stages' threads come and go with faults (a re-join of a
dropped server is a new gloo group with threads of its own). Measured (docs/faults.md "Memory over
the hour"): `bench/rejoin_memory.py`, 200 re-joins twice, the trainer's side grew 7.1-9.6 MiB with
the default arenas and 1.3-2.0 MiB with 2; the built-in engine's tokens/s on 2 torch threads was
not lower with it (5 alternating pairs); over an hour under `bench/nemesis.py` with it, the
verifier, server and launcher grew under 0.01 MiB/min (0.012-0.055 in an earlier hour without)."""


class ChildProcess(Protocol):
    """What supervision does with a child's process: a `subprocess.Popen`, or a
    `stream_rl.run.forkserver.ForkedProcess` (a stage forked by the fork server)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


@dataclass
class Child:
    name: str
    role: str
    cmd: list[str]
    dir: Path
    metrics_port: int | None = None
    restartable: bool = True
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables of this child on top of the launcher's (`child_env`)."""
    proc: ChildProcess | None = None
    restarts: int = 0
    started_at: float = 0.0

    @property
    def log(self) -> Path:
        return self.dir / "stdout.log"

    @property
    def dumps_stacks(self) -> bool:
        """Whether the child is a `stream-rl` command (they print every thread's stack on
        `STACKS_SIGNAL`, stream_rl/cli.py); other programs (vLLM, SGLang) may die of that signal."""
        return self.cmd[1:3] == ["-m", "stream_rl.cli"]

    def dump_stacks(self, wait_s: float = 2.0) -> bool:
        """Ask a live `stream-rl` child for its threads' stacks (into its log); True when asked.
        Waits up to `wait_s` for the log to grow (the dump is written by a C handler, even while
        the interpreter is blocked in a call)."""
        if self.proc is None or self.proc.poll() is not None or not self.dumps_stacks:
            return False

        def size() -> int:
            return self.log.stat().st_size if self.log.exists() else 0

        before = size()
        self.proc.send_signal(STACKS_SIGNAL)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and size() == before:
            time.sleep(0.1)
        time.sleep(0.2)  # the rest of the dump (one write per frame)
        return True

    def kill_ignoring_sigterm(self, grace_s: float) -> int:
        """The child did not stop within `grace_s` of SIGTERM: its stacks into its log, a line
        saying so, SIGKILL; returns its exit code."""
        assert self.proc is not None
        where = f" (its threads' stacks: end of {self.log})" if self.dump_stacks() else ""
        print(
            f"{self.name} did not stop within {grace_s:.0f}s of SIGTERM: killing it{where}", file=sys.stderr
        )
        self.proc.kill()
        return self.proc.wait()

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def child_index(child: Child) -> int:
    """The instance index in a child's name (`actor-2` -> 2; 0 for a single `trainer`)."""
    head, _, tail = child.name.rpartition("-")
    return int(tail) if head and tail.isdigit() else 0


def run_admin_token(config: RunConfig) -> str | None:
    """The token guarding the launched servers' `/weights/*`: the configured one, else a fresh one
    per run (when the launcher starts the servers). It travels in the children's environment only,
    never into run directories or logs."""
    if config.inference.admin_token is not None:
        return config.inference.admin_token.get_secret_value()
    if config.inference.servers or config.inference.num_servers == 0:
        return None  # servers started by the user carry the token they were given (if any)
    import secrets

    return secrets.token_urlsafe(32)


def run_api_key(config: RunConfig) -> str | None:
    """The key guarding the servers' OpenAI routes (`/v1/*`): the configured one
    (`inference.api_key`, else $VLLM_API_KEY), else a fresh one per run when the launcher starts
    servers that listen beyond loopback (anyone who reaches the port could sample otherwise),
    else None. Like the admin token it travels in the children's environment only ($VLLM_API_KEY:
    the built-in server, vLLM and every client here read it), never on a command line (`ps`)."""
    secret = config.inference.api_key_secret()
    if secret is not None:
        return secret.get_secret_value()
    inf = config.inference
    if inf.servers or inf.num_servers == 0 or not inf.listens_beyond_loopback():
        return None
    import secrets

    return secrets.token_urlsafe(32)


FORK_SERVER = "fork-server"
"""`child_env`'s role for the fork server: no kind of process, so none of their secrets (a forked
stage's /proc/<pid>/environ shows the server's initial environment; `spawn` sets its own secret in
its os.environ)."""


def others_secret_env(config: RunConfig, role: str | None) -> set[str]:
    """The environment variables `kafka.credentials` names as secrets (`${NAME}`) of kinds of process
    other than `role` and not of `role` itself nor shared (`kafka.secret_properties`): left out of
    that child's environment, so a stage holds its own principal's secret only."""
    kafka = config.kafka

    def env_refs(refs: dict[str, str]) -> set[str]:
        return {r[2:-1] for r in refs.values() if r.startswith("${") and r.endswith("}")}

    own = env_refs(kafka.secret_properties)
    others: set[str] = set()
    for kind, creds in kafka.credentials.items():
        (own if kind == role else others).update(env_refs(creds.secret_properties))
    return others - own


def child_env(
    config: RunConfig, admin_token: str | None = None, api_key: str | None = None, role: str | None = None
) -> dict[str, str]:
    """The launcher's environment plus what every child needs; the run's admin token and API key
    when set (a `None` key leaves an inherited $VLLM_API_KEY alone: `run_api_key` returned it).
    With `role` (a stage's kind), the other kinds' Kafka secrets named by environment variable are
    left out (`others_secret_env`). glibc's arenas are capped (`MALLOC_ARENA_MAX`) for every child
    but a vLLM or SGLang server, unless the launcher's environment sets the cap itself."""
    # The launcher has reached the broker: a child (re)started during an outage waits it out
    # instead of failing fast as for a wrong address.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", REACHABLE_WAIT_ENV: str(config.kafka.outage_timeout_s)}
    if role != "server" or config.inference.engine == "builtin":  # vLLM's and SGLang's are theirs
        env.setdefault("MALLOC_ARENA_MAX", MALLOC_ARENA_MAX)
    for name in others_secret_env(config, role) if role is not None else ():
        env.pop(name, None)
    if admin_token is not None:
        env[ADMIN_TOKEN_ENV] = admin_token
    if api_key is not None:
        env[API_KEY_ENV] = api_key
    return env


def die_with_parent() -> None:
    """In the child, before exec: SIGTERM it when the launcher dies, however it dies (a killed or
    crashed launcher otherwise leaves its stages running, waiting on a broker that is gone)."""
    import contextlib
    import ctypes

    with contextlib.suppress(OSError):  # not Linux: children may outlive a crashed launcher
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
