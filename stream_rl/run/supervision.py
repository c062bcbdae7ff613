"""`Supervision`, the launcher's process half: it starts the children, waits for the inference
servers, writes where every process listens (`processes.json`, the Prometheus targets), handles a
child's exit (restart or stop the run) and the watchdog's stalls, and stops them all in waves.
`stream_rl.run.launch.Launcher` composes it with the run's preparation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stream_rl.config import RunConfig
from stream_rl.contracts import WeightVersionKind
from stream_rl.errors import StreamRLError
from stream_rl.kafka.hanging import HangingWatch, run_scope
from stream_rl.kafka.stage import StopFlag
from stream_rl.run.children import FORK_SERVER, Child, child_env, child_index, die_with_parent
from stream_rl.run.watchdog import Watchdog

if TYPE_CHECKING:
    from stream_rl.run.forkserver import ForkServer

STOP_GRACE_S = 20.0


class Supervision:
    """The children of one run and what is done with them; `Launcher.__init__` sets the state."""

    config: RunConfig
    stop: StopFlag
    run_dir: Path
    children: list[Child]
    bootstrap: str
    exit_reason: str
    failed: Child | None
    server_startup_s: float
    stalled: str | None
    admin_token: str | None
    api_key: str | None
    _launcher_port: int | None
    _fork_server: ForkServer | None

    def write_ports(self, launcher_port: int) -> None:
        """processes.json (for `stream-rl status`) and prometheus-targets.json (file_sd for
        deploy/prometheus.yml)."""
        self._launcher_port = launcher_port
        ports = {c.name: c.metrics_port for c in self.children if c.metrics_port}
        servers = self.server_urls()
        # Live children only: a dead child's pid may already belong to another process.
        pids = {c.name: c.proc.pid for c in self.children if c.proc and c.proc.poll() is None}
        tmp = self.run_dir / "processes.json.tmp"
        tmp.write_text(
            json.dumps(
                {
                    "bootstrap": self.bootstrap,
                    "metrics_ports": ports,
                    "servers": servers,
                    "launcher_port": launcher_port,
                    "launcher_pid": os.getpid(),
                    "pids": pids,
                },
                indent=2,
            )
        )
        tmp.replace(self.run_dir / "processes.json")  # readers never see half a file
        run = self.config.run

        def target(address: str, process: str, role: str) -> dict[str, Any]:
            return {"targets": [address], "labels": {"run": run, "process": process, "role": role}}

        targets = [target(f"127.0.0.1:{port}", name, name.rsplit("-", 1)[0]) for name, port in ports.items()]
        targets += [target(url.split("://", 1)[-1], f"server-{i}", "server") for i, url in enumerate(servers)]
        targets.append(target(f"127.0.0.1:{launcher_port}", "launcher", "launcher"))
        (self.run_dir / "prometheus-targets.json").write_text(json.dumps(targets, indent=2))

    def server_url(self, index: int) -> str:
        """The URL of launched server `index`."""
        return self.config.inference.launched_url(index)

    def server_urls(self) -> list[str]:
        """The run's servers now: the configured ones, or the launched ones (`scale` changes them)."""
        if self.config.inference.servers:
            return self.config.inference.server_urls()
        launched = sorted(child_index(c) for c in self.children if c.role == "server")
        return [self.server_url(i) for i in launched]

    # -- processes -------------------------------------------------------------------------
    def start_fork_server(self) -> None:
        """The fork server the CPU run's `stream-rl` children are forked from (`launcher.fork_stages`,
        `stream_rl/run/forkserver.py`); it starts importing at once, while the launcher goes on."""
        from stream_rl.run import forkserver

        cfg = self.config
        on_cpu = cfg.trainer.device == "cpu" and cfg.inference.device == "cpu"
        if cfg.launcher.fork_stages == "off" or not on_cpu or not forkserver.available():
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # No kind's Kafka secret: a forked stage's /proc/<pid>/environ shows the server's initial
        # environment (its own secret is set in os.environ by `spawn`).
        env = child_env(self.config, self.admin_token, self.api_key, role=FORK_SERVER)
        log = self.run_dir / "forkserver.log"
        self._fork_server = forkserver.ForkServer.start(env, log, cfg.model.path)
        print(
            f"stages fork from one process that imports torch once (launcher.fork_stages: auto; its log: {log})",
            file=sys.stderr,
        )

    def stop_fork_server(self) -> None:
        if self._fork_server is not None:
            self._fork_server.close()
            self._fork_server = None

    def spawn(self, child: Child) -> None:
        env = {**child_env(self.config, self.admin_token, self.api_key, role=child.role), **child.env}
        server = self._fork_server
        forked = False
        if server is not None and child.dumps_stacks and child.cmd[0] == sys.executable:
            try:
                child.proc = server.spawn(child.cmd, env, child.log, timeout_s=self.server_startup_s)
                forked = True
            except OSError as exc:
                print(f"{exc}: {child.name} and the children after it start as programs", file=sys.stderr)
                self.stop_fork_server()
        if not forked:
            # The child gets its own copy of the log's file descriptor; ours closes at once.
            with open(child.log, "ab") as log:
                child.proc = subprocess.Popen(
                    child.cmd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    preexec_fn=die_with_parent,
                )
        child.started_at = time.monotonic()
        if self._launcher_port is not None:
            self.write_ports(self._launcher_port)  # a restarted child's new pid, for `status`

    def check_server_ports(self) -> None:
        """Fail before starting anything if a launched server's port is taken (another run?)."""
        from stream_rl.common.ports import port_is_free

        inf = self.config.inference
        for child in self.children:
            if child.role != "server":
                continue
            port = inf.launched_port(int(child.name.rsplit("-", 1)[1]))
            if not port_is_free(port, inf.host):
                raise StreamRLError(
                    f"port {port} for {child.name} is taken (another run's server?): "
                    f"choose others with --set inference.base_port=<port>"
                )

    def wait_for_servers(self) -> None:
        import httpx

        timeout = self.server_startup_s
        servers = [c for c in self.children if c.role == "server"]
        deadline = time.monotonic() + timeout
        # One client for the whole wait: each `httpx.get` builds an SSL context (~25 ms of CPU).
        with httpx.Client(timeout=2.0) as http:
            for url in self.server_urls():
                while True:
                    dead = next((c for c in servers if c.proc and c.proc.poll() is not None), None)
                    if dead is not None:
                        self.failed = dead
                        raise StreamRLError(self.death_message(dead))
                    try:
                        if http.get(f"{url}/health").status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > deadline:
                        raise StreamRLError(
                            f"inference server {url} not healthy after {timeout:.0f}s (see its log in {self.run_dir}/server-*)"
                        )
                    if self.stop:
                        return
                    time.sleep(0.3)

    def death_message(self, child: Child) -> str:
        code = child.proc.returncode if child.proc else None
        how = (
            f"killed by {signal.Signals(-code).name}"
            if code is not None and code < 0
            else f"exit code {code}"
        )
        return f"{child.name} died ({how}); last lines of {child.log}:\n{child.tail()}"

    def check_children(self) -> bool:
        """Handle exits; returns False when the run must stop."""
        for child in self.children:
            if child.proc is None or child.proc.poll() is None:
                continue
            code = child.proc.returncode
            if child.role in ("loader", "evaluator", "track") and code == 0:
                continue  # its job is done (the evaluator's: the final version is evaluated)
            if child.role == "trainer" and code == 0:
                self.exit_reason = "trainer finished"
                return False
            if (
                self.config.launcher.restart
                and child.restartable
                and child.restarts < self.config.launcher.max_restarts
            ):
                child.restarts += 1
                print(
                    f"\n{self.death_message(child)}\nrestarting {child.name} "
                    f"({child.restarts}/{self.config.launcher.max_restarts})",
                    file=sys.stderr,
                )
                self.spawn(child)
                continue
            self.failed = child
            self.exit_reason = f"{child.name} died"
            return False
        return True

    def hanging_watch(self) -> HangingWatch:
        """The check for hanging transactions on the run's topics (stream_rl/kafka/hanging.py): it
        runs once no weight version came for a while, and aborts what no coordinator will end."""
        from stream_rl.kafka.topics import TopicNames

        names = TopicNames(run=self.config.run, prefix=self.config.kafka.prefix)
        topics, own = run_scope(names)

        def say(line: str) -> None:
            print(f"\n{line}", file=sys.stderr)

        return HangingWatch(self.config.kafka, self.bootstrap, topics, own, say)

    def handle_stall(self, watchdog: Watchdog) -> bool:
        """The watchdog's verdict: False when the run must stop (see stream_rl/run/watchdog.py)."""
        now = time.monotonic()
        stall = watchdog.check(now)
        if stall is None:
            return True
        stuck = [c for c in self.children if stall.stage is not None and c.role == stall.stage]
        cfg = self.config.launcher
        live = [c for c in stuck if c.proc is not None and c.proc.poll() is None]
        # The stage blamed is the one whose input waits; the cause can sit upstream or downstream
        # of it (a preprocessor whose transaction never ends starves the trainer, and the actor
        # then waits on the lag bound): every other stage's stacks too, into its own log.
        others = [c.name for c in self.children if c not in stuck and c.dump_stacks()]
        if others:
            print(
                f"\n{stall.message}: the stacks of {', '.join(others)} are at the end of their logs",
                file=sys.stderr,
            )
        if cfg.restart and live and all(c.restarts < cfg.max_restarts for c in live):
            for child in live:
                dumped = child.dump_stacks()
                where = f" (its threads' stacks are at the end of {child.log})" if dumped else ""
                print(f"\n{stall.message}: killing {child.name} to restart it{where}", file=sys.stderr)
                assert child.proc is not None
                child.proc.kill()
                child.proc.wait()
            watchdog.reset(now)
            return True  # check_children restarts them
        for child in live:
            if child.dump_stacks():
                stall.message += f" ({child.name}'s threads' stacks are at the end of {child.log})"
        self.stalled = stall.message
        self.exit_reason = "stalled"
        return False

    def stop_all(self) -> None:
        """SIGTERM in waves, each drained before the next: producers first (so downstream
        stages see their last records), the trainer after the stages, the servers last (an
        actor finishing its in-flight requests still needs them)."""
        waves = [
            ("loader", "actor", "evaluator"),
            ("verifier", "preprocessor"),
            ("trainer", "track"),
            ("server",),
        ]
        for roles in waves:
            live = [c for c in self.children if c.role in roles and c.proc and c.proc.poll() is None]
            for child in live:
                assert child.proc is not None
                child.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            for child in live:
                assert child.proc is not None
                try:
                    child.proc.wait(max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    child.kill_ignoring_sigterm(STOP_GRACE_S)

    def read_final(self, monitor: Any, timeout_s: float = 15.0) -> None:
        """The trainer exited 0 before the monitor read its last versions (it polls every 0.5 s):
        read them, so that a run that reached max_steps says so (seen on a loaded machine: the
        summary said "trainer finished", which the run listing takes for a stopped run)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            monitor.tick()
            latest = monitor.latest
            if latest is not None and latest.kind == WeightVersionKind.FINAL:
                self.exit_reason = f"reached max_steps ({latest.step})"
                self.wait_for_eval(monitor, latest.version, "the final version")
                return
            time.sleep(0.2)

    def wait_for_eval(self, monitor: Any, version: int, what: str) -> None:
        """With an evaluator: wait (up to `eval.timeout_s`) for its result of `version` (the final
        version's: the servers stay up until it is evaluated)."""
        evaluator = next((c for c in self.children if c.role == "evaluator"), None)
        if evaluator is None:
            return
        deadline = time.monotonic() + self.config.eval.timeout_s
        while not self.stop and not monitor.has_eval(version):
            monitor.tick()
            proc = evaluator.proc
            if proc is not None and proc.poll() is not None and proc.returncode != 0:
                return  # check_children reports it
            if time.monotonic() > deadline:
                print(
                    f"\nwarning: no evaluation of {what} (version {version}) within "
                    f"eval.timeout_s={self.config.eval.timeout_s:.0f}s; going on (see {evaluator.log})",
                    file=sys.stderr,
                )
                return
            time.sleep(0.2)
