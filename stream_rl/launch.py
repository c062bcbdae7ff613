"""`stream-rl run CONFIG [--set key=value ...]`: the launcher. It only launches.

1. validates the config (one-line errors naming the bad key);
2. starts the local broker unless a bootstrap address is configured, applies the run's topics;
3. writes each child's resolved config and start command into `runs/<run>/<child>/`, starts the
   inference servers, the trainer, the loader, and the actor/verifier/preprocessor instances;
4. supervises: a child that dies stops the run with a message naming it and the tail of its
   log (or is restarted, same instance id, when `launcher.restart` is set); a progress bar shows
   step, reward, version lag and samples/s from `weight-versions`;
5. stops everything after the trainer's final version (`trainer.max_steps`), on Ctrl-C, or after
   `launcher.max_wall_s`, then writes `summary.json` and the plots (`stream_rl/report.py`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stream_rl.config import ADMIN_TOKEN_ENV, RunConfig, dump_config, load_config
from stream_rl.contracts import WeightVersionKind
from stream_rl.errors import StreamRLError
from stream_rl.identity import Identity, RunState, decide
from stream_rl.inference.servers import check_engine, launch_for
from stream_rl.kafka.broker import LocalBroker, free_port
from stream_rl.kafka.outage import REACHABLE_WAIT_ENV
from stream_rl.kafka.stage import StopFlag
from stream_rl.watchdog import Watchdog

STOP_GRACE_S = 20.0
SAMPLE_EVERY_S = 2.0


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
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0

    @property
    def log(self) -> Path:
        return self.dir / "stdout.log"

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


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


def child_env(config: RunConfig, admin_token: str | None = None) -> dict[str, str]:
    # The launcher has reached the broker: a child (re)started during an outage waits it out
    # instead of failing fast as for a wrong address.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", REACHABLE_WAIT_ENV: str(config.kafka.outage_timeout_s)}
    if admin_token is not None:
        env[ADMIN_TOKEN_ENV] = admin_token
    return env


class Launcher:
    def __init__(self, config: RunConfig, stop: StopFlag) -> None:
        self.config = config
        self.stop = stop
        self.run_dir = config.run_dir
        self.children: list[Child] = []
        self.bootstrap = ""
        self.broker: LocalBroker | None = None
        self.exit_reason = ""
        self.failed: Child | None = None
        self.server_startup_s = 120.0
        self.stalled: str | None = None
        self.admin_token = run_admin_token(config)
        self._launcher_port: int | None = None

    # -- preparation -----------------------------------------------------------------------
    def check_config(self) -> None:
        """What the config names must exist before anything starts (one line, exit 2): the task
        (and its params) and the model directory the trainer and the launched servers load."""
        from stream_rl.errors import ConfigError
        from stream_rl.tasks import get_task

        cfg = self.config
        get_task(cfg.task.name, cfg.task.params, cfg.task.system_prompt)
        if not (Path(cfg.model.path) / "config.json").is_file():
            raise ConfigError(
                f"model.path: {cfg.model.path!r} is not a model directory (no config.json); build one "
                "with `stream-rl make-model --preset tiny --out DIR`"
            )

    def start_broker(self) -> str:
        from stream_rl.kafka.broker import resolve_bootstrap
        from stream_rl.kafka.client import check_reachable

        cfg = self.config.kafka
        if cfg.bootstrap or os.environ.get("STREAM_RL_KAFKA_BOOTSTRAP"):
            bootstrap = resolve_bootstrap(None, cfg.bootstrap)
            check_reachable(bootstrap)  # one line within seconds when nothing answers there
            return bootstrap
        broker = LocalBroker(cfg.data_dir, port=cfg.port)
        already_running = broker.running() is not None
        bootstrap = broker.up(quiet=False).bootstrap
        if not already_running:
            self.broker = broker  # ours to stop at the end
        return bootstrap

    def check_identity(self) -> Identity:
        """New, resume, or refuse (`stream_rl/identity.py`), before anything starts."""
        import shutil

        from stream_rl.kafka.client import KafkaTransport
        from stream_rl.kafka.topics import WEIGHT_VERSIONS, TopicNames
        from stream_rl.train.lineage import read_weight_versions

        kafka = KafkaTransport(self.bootstrap)
        names = TopicNames(run=self.config.run, prefix=self.config.kafka.prefix)
        lineage = (
            read_weight_versions(kafka, names)
            if names[WEIGHT_VERSIONS] in set(kafka.list_topic_names())
            else []
        )
        identity = decide(self.config, lineage, self.bootstrap)
        if identity.state == RunState.NEVER_TRAINED:
            # The trainer's record describes the config of its first start: that start trained nothing.
            shutil.rmtree(self.run_dir / "trainer" / "record", ignore_errors=True)
        if identity.message:
            print(identity.message, file=sys.stderr)
        return identity

    def apply_topics(self) -> None:
        from stream_rl.kafka.client import KafkaTransport
        from stream_rl.kafka.topics import TopicNames, apply_topics, publish_schemas

        kafka = KafkaTransport(self.bootstrap)
        names = TopicNames(run=self.config.run, prefix=self.config.kafka.prefix)
        report = apply_topics(kafka, names, self.config.kafka.partitions)
        publish_schemas(kafka, names)
        for line in report.drift:
            print(f"warning: topic differs from the topology: {line}", file=sys.stderr)

    def plan(self) -> None:
        """Build every child's command and write its config and command into its directory."""
        cfg = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(dump_config(cfg))
        py = [sys.executable, "-m", "stream_rl.cli"]
        inf = cfg.inference
        if not inf.servers:
            for i in range(inf.num_servers):
                launch = launch_for(cfg, i)
                self._add(f"server-{i}", "server", launch.cmd, metrics=False, env=launch.env)
                self.server_startup_s = launch.startup_timeout_s
        stage_counts = [
            ("trainer", 1),
            ("loader", 1),
            ("evaluator", 1 if cfg.eval.every else 0),
            ("preprocessor", cfg.launcher.preprocessors),
            ("verifier", cfg.launcher.verifiers),
            ("actor", cfg.launcher.actors),
        ]
        for role, count in stage_counts:
            for i in range(count):
                name = f"{role}-{i}" if count > 1 or role in ("actor", "verifier", "preprocessor") else role
                child_dir = self.run_dir / name
                child_dir.mkdir(parents=True, exist_ok=True)
                config_path = child_dir / "config.yaml"
                config_path.write_text(dump_config(cfg))
                cmd = [*py, role, "--config", str(config_path), "--bootstrap", self.bootstrap]
                if role not in ("loader",):
                    cmd += ["--instance", str(i)]
                # The loader is idempotent (it writes only the missing records): restartable too.
                self._add(name, role, cmd, metrics=role != "loader")

        if cfg.track.to:
            cmd = [
                *py,
                "track",
                "--run",
                cfg.run,
                "--runs-dir",
                cfg.runs_dir,
                "--follow",
                "--bootstrap",
                self.bootstrap,
            ]
            self._add("tracker", "track", cmd, metrics=False, restartable=False)

    def _add(
        self,
        name: str,
        role: str,
        cmd: list[str],
        metrics: bool = True,
        restartable: bool = True,
        env: dict[str, str] | None = None,
    ) -> None:
        child_dir = self.run_dir / name
        child_dir.mkdir(parents=True, exist_ok=True)
        port = free_port() if metrics else None
        if port is not None:
            cmd = [*cmd, "--metrics-port", str(port)]
        env = env or {}
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        (child_dir / "cmd.txt").write_text((prefix + " " if prefix else "") + shlex.join(cmd) + "\n")
        self.children.append(Child(name, role, cmd, child_dir, port, restartable, env))

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

    def server_urls(self) -> list[str]:
        return self.config.inference.server_urls()

    # -- processes -------------------------------------------------------------------------
    def spawn(self, child: Child) -> None:
        # The child gets its own copy of the log's file descriptor; ours closes at once.
        with open(child.log, "ab") as log:
            child.proc = subprocess.Popen(
                child.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**child_env(self.config, self.admin_token), **child.env},
                preexec_fn=_die_with_parent,
            )
        child.started_at = time.monotonic()
        if self._launcher_port is not None:
            self.write_ports(self._launcher_port)  # a restarted child's new pid, for `status`

    def check_server_ports(self) -> None:
        """Fail before starting anything if a launched server's port is taken (another run?)."""
        from stream_rl.kafka.broker import port_is_free

        inf = self.config.inference
        for child in self.children:
            if child.role != "server":
                continue
            port = inf.base_port + int(child.name.rsplit("-", 1)[1])
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
        for url in self.server_urls():
            while True:
                dead = next((c for c in servers if c.proc and c.proc.poll() is not None), None)
                if dead is not None:
                    self.failed = dead
                    raise StreamRLError(self.death_message(dead))
                try:
                    if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
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

    def handle_stall(self, watchdog: Watchdog) -> bool:
        """The watchdog's verdict: False when the run must stop (see stream_rl/watchdog.py)."""
        now = time.monotonic()
        stall = watchdog.check(now)
        if stall is None:
            return True
        stuck = [c for c in self.children if stall.stage is not None and c.role == stall.stage]
        cfg = self.config.launcher
        live = [c for c in stuck if c.proc is not None and c.proc.poll() is None]
        if cfg.restart and live and all(c.restarts < cfg.max_restarts for c in live):
            for child in live:
                print(f"\n{stall.message}: killing {child.name} to restart it", file=sys.stderr)
                assert child.proc is not None
                child.proc.kill()
                child.proc.wait()
            watchdog.reset(now)
            return True  # check_children restarts them
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
                    print(
                        f"{child.name} did not stop within {STOP_GRACE_S:.0f}s of SIGTERM: killing it",
                        file=sys.stderr,
                    )
                    child.proc.kill()
                    child.proc.wait()

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

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> int:
        try:
            return self._run()
        finally:
            self._stop_broker()

    def _stop_broker(self) -> None:
        if self.broker is None or self.config.launcher.keep_broker:
            return
        gc.collect()  # the run's Kafka clients are gone before their broker (no reconnect noise)
        self.broker.down(quiet=True)
        print(
            f"stopped the local Kafka broker; its data stays in {self.broker.data_dir} "
            f"(`stream-rl kafka up --data-dir {self.config.kafka.data_dir} --port {self.config.kafka.port}` "
            f"brings it back, e.g. to replay)",
            file=sys.stderr,
        )

    def _run(self) -> int:
        from stream_rl.metrics import serve_metrics
        from stream_rl.monitor import RunMonitor

        started = time.monotonic()
        self.check_config()
        engine_version = check_engine(self.config)
        if engine_version:
            print(f"inference engine: {self.config.inference.engine} {engine_version}", file=sys.stderr)
        self.bootstrap = self.start_broker()
        identity = self.check_identity()
        self.apply_topics()
        self.plan()
        self.check_server_ports()
        monitor = RunMonitor(self.config, self.bootstrap, since_version=identity.last_version)
        try:
            for child in self.children:
                if child.role == "server":
                    self.spawn(child)
            self.wait_for_servers()
            for child in self.children:
                if child.role != "server":
                    self.spawn(child)
            self.write_ports(serve_metrics(0))
            monitor.start()
            max_wall = self.config.launcher.max_wall_s
            stall_s = self.config.launcher.stall_timeout_s
            watchdog = Watchdog(stall_s) if stall_s is not None else None
            while not self.stop:
                if not self.check_children():
                    break
                monitor.tick()
                if watchdog is not None and monitor.sample is not None:
                    watchdog.observe(time.monotonic(), monitor.sample)
                    if not self.handle_stall(watchdog):
                        break
                latest = monitor.latest
                if latest is not None and latest.kind == WeightVersionKind.FINAL:
                    self.exit_reason = f"reached max_steps ({latest.step})"
                    self.wait_for_eval(monitor, latest.version, "the final version")
                    break
                if max_wall is not None and time.monotonic() - started > max_wall:
                    self.exit_reason = f"max_wall_s ({max_wall:.0f}s) reached"
                    break
                time.sleep(0.5)
            else:
                self.exit_reason = self.stop.reason or "stopped"
        finally:
            self.stop_all()
            if self._launcher_port is not None:
                self.write_ports(self._launcher_port)  # no pids left: the run is over
            monitor.close()
            summary = monitor.finish(
                wall_s=time.monotonic() - started,
                exit_reason=self.exit_reason,
                failed=self.failed.name if self.failed else None,
            )
        if self.failed is not None:
            print(f"\nrun {self.config.run} stopped: {self.death_message(self.failed)}", file=sys.stderr)
            return 1
        if self.stalled is not None:
            print(f"\nrun {self.config.run} stopped: {self.stalled}", file=sys.stderr)
            return 1
        _print_summary(summary, self.run_dir)
        return 0


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM it when the launcher dies, however it dies (a killed or
    crashed launcher otherwise leaves its stages running, waiting on a broker that is gone)."""
    import contextlib
    import ctypes

    with contextlib.suppress(OSError):  # not Linux: children may outlive a crashed launcher
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if not isinstance(value, int | float) else format(value, spec)


def summary_line(summary: dict[str, Any]) -> str:
    """One line for what this invocation trained (never the figures of an earlier invocation)."""
    v = summary.get("versions") or {}
    r = summary.get("reward") or {}
    how = "finished" if str(summary.get("exit_reason", "")).startswith("reached max_steps") else "stopped"
    head = f"run {summary.get('run')} {how} ({summary.get('exit_reason')}) after {_fmt(summary.get('wall_s'), '.0f')}s"
    if summary.get("resumed_from") is not None:
        head += f", resumed at version {summary['resumed_from']}"
    if not v.get("count"):
        return head + ": no version trained by this invocation"
    line = (
        f"{head}: trained versions {v.get('first')}-{v.get('last')}, reward "
        f"{_fmt(r.get('first3_mean'))} -> {_fmt(r.get('last3_mean'))}"
    )
    ev = (summary.get("eval") or {}).get("last")
    if ev:
        line += f", eval pass@1 {_fmt((summary['eval'].get('first') or {}).get('pass_at_1'))} -> {_fmt(ev.get('pass_at_1'))} (version {ev.get('version')})"
    return line


def _print_summary(summary: dict[str, Any], run_dir: Path) -> None:
    print("\n" + summary_line(summary))
    print(f"summary: {run_dir / 'summary.json'}; plots: {run_dir / 'plots'}")


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config_file", metavar="CONFIG", help="run config YAML (see configs/)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set trainer.max_steps=20 (repeatable)",
    )


def main_run(args: argparse.Namespace) -> int:
    config = load_config(args.config_file, args.overrides)
    stop = StopFlag()
    stop.install_signal_handlers()
    return Launcher(config, stop).run()
