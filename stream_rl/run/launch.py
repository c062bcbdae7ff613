"""`stream-rl run CONFIG [--set key=value ...]`: the launcher. It only launches.

1. validates the config (one-line errors naming the bad key);
2. starts the local broker unless a bootstrap address is configured, applies the run's topics;
3. writes each child's resolved config and start command into `runs/<run>/<child>/`, starts the
   inference servers, the trainer, the loader, and the actor/verifier/preprocessor instances;
4. supervises: a child that dies stops the run with a message naming it and the tail of its
   log (or is restarted, same instance id, when `launcher.restart` is set); a progress bar shows
   step, reward, version lag and samples/s from `weight-versions`;
5. stops everything after the trainer's final version (`trainer.max_steps`), on Ctrl-C, or after
   `launcher.max_wall_s`, then writes `summary.json` and the plots (`stream_rl/observe/report.py`).

Split by role: `stream_rl.run.children` (a child process, its environment), `stream_rl.run.supervision`
(starting, watching, restarting and stopping the children); this module holds the run's
preparation (steps 1-3), the run loop and the CLI entry, and re-exports the others' names.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from stream_rl.common import heap
from stream_rl.common.ports import free_port
from stream_rl.config import RunConfig, dump_config, load_config
from stream_rl.contracts import WeightVersionKind
from stream_rl.inference.launching import check_engine, launch_for
from stream_rl.kafka.broker import LocalBroker
from stream_rl.kafka.stage import StopFlag
from stream_rl.run.autoscale import autoscaler_for
from stream_rl.run.children import Child, child_env, die_with_parent, run_admin_token, run_api_key
from stream_rl.run.identity import Identity, RunState, decide
from stream_rl.run.scaling import Scaling
from stream_rl.run.supervision import STOP_GRACE_S, Supervision
from stream_rl.run.watchdog import Watchdog
from stream_rl.train.record import engine_label, software, software_header

__all__ = [
    "STOP_GRACE_S",
    "Child",
    "Launcher",
    "add_run_arguments",
    "child_env",
    "die_with_parent",
    "main_run",
    "run_admin_token",
    "run_api_key",
    "summary_line",
]


class Launcher(Supervision, Scaling):
    def __init__(self, config: RunConfig, stop: StopFlag) -> None:
        # Its own Kafka clients as the launcher (kafka.credentials.launcher); each stage's config
        # gets that stage's credentials only (add_stage).
        self.config = config.model_copy(update={"kafka": config.kafka.acting_as("launcher")})
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
        self.api_key = run_api_key(config)
        self._launcher_port: int | None = None
        self._kafka = None
        self._scaled_servers: set[str] = set()
        self._fork_server = None
        self.software: dict[str, str | None] = software(config.inference.engine)
        """The versions this invocation runs (the engine's once probed): headed into the run's
        config.yaml and the summary."""

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
        from stream_rl.kafka.confluent import check_reachable

        cfg = self.config.kafka
        if cfg.bootstrap or os.environ.get("STREAM_RL_KAFKA_BOOTSTRAP"):
            bootstrap = resolve_bootstrap(None, cfg.bootstrap)
            check_reachable(
                bootstrap, properties=cfg.librdkafka_properties()
            )  # one line within seconds when nothing answers there
            return bootstrap
        from stream_rl.kafka.cluster import LocalCluster, cluster_layout

        layout = cluster_layout(cfg.data_dir)
        if layout is not None:
            # A local cluster made by `stream-rl kafka up --brokers N`: started if needed, left
            # running (it is the user's, like a cluster named by kafka.bootstrap).
            return LocalCluster(cfg.data_dir, brokers=len(layout.ports)).up(quiet=False)
        broker = LocalBroker(cfg.data_dir, port=cfg.port)
        already_running = broker.running() is not None
        bootstrap = broker.up(quiet=False).bootstrap
        if not already_running:
            self.broker = broker  # ours to stop at the end
        return bootstrap

    def check_identity(self) -> Identity:
        """New, resume, or refuse (`stream_rl/run/identity.py`), before anything starts."""
        import shutil

        from stream_rl.kafka.confluent import KafkaTransport
        from stream_rl.kafka.topics import WEIGHT_VERSIONS, TopicNames
        from stream_rl.train.lineage import read_weight_versions

        kafka = KafkaTransport.for_run(self.config.kafka, self.bootstrap)
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
        from stream_rl.kafka.confluent import KafkaTransport
        from stream_rl.kafka.topics import TopicNames, apply_topics, publish_schemas

        kafka = KafkaTransport.for_run(self.config.kafka, self.bootstrap)
        names = TopicNames(run=self.config.run, prefix=self.config.kafka.prefix)
        cfg = self.config.kafka
        report = apply_topics(
            kafka,
            names,
            cfg.partitions,
            replication_factor=cfg.replication_factor,
            min_insync_replicas=cfg.min_insync_replicas,
        )
        publish_schemas(kafka, names)
        for line in report.drift:
            print(f"warning: topic differs from the topology: {line}", file=sys.stderr)

    def plan(self) -> None:
        """Build every child's command and write its config and command into its directory."""
        cfg = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(software_header(self.software) + dump_config(cfg))
        py = [sys.executable, "-m", "stream_rl.cli"]
        inf = cfg.inference
        if not inf.servers:
            for i in range(inf.num_servers):
                self.add_server(i)
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
                self.add_stage(role, i, name)

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

    def add_stage(self, role: str, index: int, name: str | None = None) -> Child:
        """The child running stage `role` as instance `index` (its config and command written into
        `runs/<run>/<name>/`); not started."""
        name = name or f"{role}-{index}"
        child_dir = self.run_dir / name
        child_dir.mkdir(parents=True, exist_ok=True)
        config_path = child_dir / "config.yaml"
        own = self.config.model_copy(update={"kafka": self.config.kafka.for_role(role)})
        config_path.write_text(dump_config(own))
        cmd = [
            sys.executable,
            "-m",
            "stream_rl.cli",
            role,
            "--config",
            str(config_path),
            "--bootstrap",
            self.bootstrap,
        ]
        if role not in ("loader",):
            cmd += ["--instance", str(index)]
        # The loader is idempotent (it writes only the missing records): restartable too.
        return self._add(name, role, cmd, metrics=role != "loader")

    def add_server(self, index: int) -> Child:
        """The child running launched server `index` (port `base_port + index`); not started."""
        launch = launch_for(self.config, index)
        self.server_startup_s = launch.startup_timeout_s
        return self._add(f"server-{index}", "server", launch.cmd, metrics=False, env=launch.env)

    def _add(
        self,
        name: str,
        role: str,
        cmd: list[str],
        metrics: bool = True,
        restartable: bool = True,
        env: dict[str, str] | None = None,
    ) -> Child:
        child_dir = self.run_dir / name
        child_dir.mkdir(parents=True, exist_ok=True)
        port = free_port() if metrics else None
        if port is not None:
            cmd = [*cmd, "--metrics-port", str(port)]
        env = env or {}
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        (child_dir / "cmd.txt").write_text((prefix + " " if prefix else "") + shlex.join(cmd) + "\n")
        child = Child(name, role, cmd, child_dir, port, restartable, env)
        self.children.append(child)
        return child

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> int:
        try:
            return self._run()
        finally:
            self.stop_fork_server()
            self._stop_broker()

    def _stop_broker(self) -> None:
        if self.broker is None or self.config.launcher.keep_broker:
            return
        heap.release()  # the run's Kafka clients are gone before their broker (no reconnect noise)
        self.broker.down(quiet=True)
        print(
            f"stopped the local Kafka broker; its data stays in {self.broker.data_dir} "
            f"(`stream-rl kafka up --data-dir {self.config.kafka.data_dir} --port {self.config.kafka.port}` "
            f"brings it back, e.g. to replay)",
            file=sys.stderr,
        )

    def _run(self) -> int:
        from stream_rl.common.metrics import serve_metrics
        from stream_rl.run.monitor import RunMonitor

        started = time.monotonic()
        self.check_config()
        engine_version = check_engine(self.config)
        if engine_version:
            print(f"inference engine: {self.config.inference.engine} {engine_version}", file=sys.stderr)
        self.software = {
            **self.software,
            "engine": engine_label(self.config.inference.engine, engine_version),
        }
        self.bootstrap = self.start_broker()
        identity = self.check_identity()
        self.start_fork_server()
        self.apply_topics()
        self.plan()
        self.check_server_ports()
        monitor = RunMonitor(
            self.config, self.bootstrap, since_version=identity.last_version, software=self.software
        )
        try:
            for child in self.children:
                if child.role == "server":
                    self.spawn(child)
            self.wait_for_servers()
            for url in self.rejoin_launched():
                print(f"{url} was left by an earlier invocation's `scale`: joined again", file=sys.stderr)
            for child in self.children:
                if child.role != "server":
                    self.spawn(child)
            self.write_ports(serve_metrics(0))
            monitor.start()
            autoscaler = autoscaler_for(self, monitor)
            heap.settle()
            max_wall = self.config.launcher.max_wall_s
            stall_s = self.config.launcher.stall_timeout_s
            watchdog = Watchdog(stall_s) if stall_s is not None else None
            hanging = self.hanging_watch()
            while not self.stop:
                if not self.check_children():
                    if self.exit_reason == "trainer finished":
                        self.read_final(monitor)
                    break
                self.check_scale()  # before the tick: a scale can take a while (a server joining)
                monitor.tick()
                if autoscaler is not None:
                    autoscaler.tick()  # after the tick: it acts on the monitor's new sample
                if monitor.sample is not None:
                    hanging.tick(time.monotonic(), monitor.sample.version, monitor.sample.held)
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
            self.leave_scaled_servers()
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
        line += ", " + eval_moves((summary["eval"].get("first") or {}), ev)
    return line


def eval_moves(first: dict[str, Any], last: dict[str, Any]) -> str:
    """What the held-out evaluation moved, each figure named: sampled pass@1 and pass@k (at the
    eval temperature, what the policy does when it samples) and greedy pass@1 (temperature 0;
    a tiny model can score high greedily from the start, so it alone can read as if training
    hurt)."""
    split = last.get("split") or "held-out"
    out = f"eval on {split} (version {first.get('version', '-')} -> {last.get('version')}):"
    moves = []
    for key, label in (("sampled_pass_at_1", "sampled pass@1"), ("pass_at_k", f"pass@{last.get('k')}"),
                       ("pass_at_1", "greedy pass@1")):  # fmt: skip
        if isinstance(last.get(key), int | float):
            moves.append(f"{label} {_fmt(first.get(key))} -> {_fmt(last.get(key))}")
    return out + " " + ", ".join(moves) if moves else out + " no figures"


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
