"""`stream-rl scale --run R actor=1 verifier=2 preprocessor=2 server=2`: change the replicas of a
launcher-managed run while it trains.

The command writes `runs/<run>/scale-request.json` (`{"id", "counts"}`); the run's launcher reads
it within half a second (`Scaling.check_scale`, in its loop), checks every count before it changes
anything, applies them and answers in `runs/<run>/scale-result.json` (`{"id", "lines", "error"}`),
which the command prints (exit 2 with the error, nothing changed). What the launcher does:

- **verifier, preprocessor**: starts instances `<role>-<i>` (the next indices; they join their
  consumer group) or stops the highest ones with SIGTERM (a clean drain), then removes the stopped
  static member from its group so that its partitions are reassigned at once
  (`stream_rl.kafka.members`; on a secured cluster they move when its session expires).
- **actor**: the same; actors share the staleness bound by the partitions of `problems` they
  hold (`stream_rl.stages.admission`), so any number works (more actors than partitions idle).
  A run whose lineage began before the per-partition counts is held to `launcher.actors`.
- **server** (launched servers only, `inference.num_servers`): a new `server-<i>` on
  `base_port + i` is started, joined to the run as `stream-rl servers join` does
  (`docs/servers-protocol.md`: the trainer pushes it the current version, the actors route to it
  once it holds the newest) and the command returns once it does; the highest ones leave as
  `stream-rl servers leave` does (drained, then stopped).

A server added this way is announced `left` when the run stops, so that the next invocation does
not wait for it; the launched servers found `draining` or `left` by a new invocation are announced
`joined` again (it starts them).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stream_rl.config import RunConfig
from stream_rl.errors import ConfigError, StreamRLError
from stream_rl.kafka.transport import Transport
from stream_rl.run.children import Child, child_index

ROLES = ("actor", "verifier", "preprocessor", "server")
REQUEST = "scale-request.json"
RESULT = "scale-result.json"
STOP_GRACE_S = 20.0
JOIN_TIMEOUT_S = 300.0


def parse_counts(items: list[str]) -> dict[str, int]:
    """`["actor=2", "server=3"]` -> `{"actor": 2, "server": 3}` (one-line `ConfigError` otherwise)."""
    counts: dict[str, int] = {}
    for item in items:
        role, _, value = item.partition("=")
        if role not in ROLES or not value.strip().isdigit():
            raise ConfigError(f"{item!r}: expected ROLE=N with ROLE one of {', '.join(ROLES)} and N a count")
        if role in counts:
            raise ConfigError(f"{role} given twice")
        counts[role] = int(value)
    if not counts:
        raise ConfigError(f"nothing to scale: give ROLE=N for some of {', '.join(ROLES)}")
    return counts


def _index(child: Child) -> int:
    return child_index(child)


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)  # readers never see half a file


class Scaling:
    """The launcher's half of `stream-rl scale` (mixed into `stream_rl.run.launch.Launcher`)."""

    config: RunConfig
    run_dir: Path
    children: list[Child]
    bootstrap: str
    server_startup_s: float
    api_key: str | None
    _launcher_port: int | None

    _kafka: Transport | None
    _scaled_servers: set[str]
    """Servers `scale` added (announced `left` when the run stops)."""

    if TYPE_CHECKING:

        def add_stage(self, role: str, index: int, name: str | None = None) -> Child: ...
        def add_server(self, index: int) -> Child: ...
        def spawn(self, child: Child) -> None: ...
        def write_ports(self, launcher_port: int) -> None: ...
        def server_url(self, index: int) -> str: ...
        def server_urls(self) -> list[str]: ...

    # -- the servers ---------------------------------------------------------------------------
    def _transport(self) -> tuple[Transport, Any]:
        from stream_rl.kafka.confluent import KafkaTransport
        from stream_rl.kafka.topics import TopicNames

        if self._kafka is None:
            self._kafka = KafkaTransport.for_run(self.config.kafka, self.bootstrap)
        return self._kafka, TopicNames(run=self.config.run, prefix=self.config.kafka.prefix)

    def rejoin_launched(self) -> list[str]:
        """Launched servers an earlier invocation left `draining` or `left` (scaled down, or added
        and stopped with it) are `joined` again: this invocation starts them."""
        from stream_rl.contracts import MembershipState, ServerMembership
        from stream_rl.kafka.servers_topic import announce, read_members

        if self.config.inference.servers:
            return []
        transport, names = self._transport()
        members = read_members(transport, names)
        rejoined = []
        for url in self.server_urls():
            m = members.get(url)
            if m is not None and not m.routable:
                engine = str(self.config.inference.engine)
                announce(
                    transport,
                    names,
                    ServerMembership(names.run, url, engine, MembershipState.JOINED, "launcher"),
                )
                rejoined.append(url)
        return rejoined

    def leave_scaled_servers(self) -> None:
        """Announce `left` for the servers `scale` added (the run is stopping them); best effort."""
        from stream_rl.contracts import MembershipState, ServerMembership
        from stream_rl.kafka.servers_topic import announce

        scaled = self._scaled_servers
        if not scaled:
            return
        try:
            transport, names = self._transport()
            engine = str(self.config.inference.engine)
            for url in sorted(scaled):
                announce(
                    transport,
                    names,
                    ServerMembership(names.run, url, engine, MembershipState.LEFT, "launcher"),
                )
        except StreamRLError as exc:
            print(f"warning: could not announce the added servers as left: {exc}", flush=True)

    # -- requests ------------------------------------------------------------------------------
    def _replicas(self, role: str) -> list[Child]:
        return sorted((c for c in self.children if c.role == role), key=_index)

    def _check(self, counts: dict[str, int]) -> None:
        cfg = self.config
        for role, n in counts.items():
            if n < 1:
                raise ConfigError(f"{role}={n}: a run needs at least one {role}")
            if role == "actor" and n > cfg.launcher.actors and not self._shares_by_partition():
                raise ConfigError(
                    f"actor={n}: at most launcher.actors ({cfg.launcher.actors}) for this run: its lineage "
                    "began before the trainer counted samples per partition, so its actors share the "
                    "staleness bound by launcher.actors; start it with the most actors it will use"
                )
            if role == "server":
                if cfg.inference.servers:
                    raise ConfigError(
                        "server=N: this run's servers are inference.servers, not launched: add others "
                        "with `stream-rl servers join`"
                    )
                from stream_rl.common.ports import port_is_free

                have = self._replicas("server")
                start = _index(have[-1]) + 1 if have else 0
                for index in range(start, start + max(0, n - len(have))):
                    port = cfg.inference.launched_port(index)
                    if not port_is_free(port, cfg.inference.host):
                        raise StreamRLError(f"server={n}: port {port} for server-{index} is taken")

    def _shares_by_partition(self) -> bool:
        """The run's latest version counts what was consumed per partition of `problems`: actors
        then share the bound by the partitions they hold, whatever their number."""
        from stream_rl.observe.status import latest_version

        transport, names = self._transport()
        wv = latest_version(transport, names)
        return wv is None or wv.attributed

    def check_scale(self) -> None:
        """Apply a `stream-rl scale` request if one is waiting (module docstring)."""
        path = self.run_dir / REQUEST
        if not path.exists():
            return
        try:
            request = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        path.unlink(missing_ok=True)
        lines: list[str] = []
        error = None
        try:
            counts = parse_counts([f"{k}={v}" for k, v in dict(request.get("counts") or {}).items()])
            self.scale_to(counts, lines.append)
        except StreamRLError as exc:
            error = str(exc)
        _write(self.run_dir / RESULT, {"id": request.get("id"), "lines": lines, "error": error})
        for line in lines:
            print(f"\nscale: {line}", flush=True)

    def scale_to(self, counts: dict[str, int], say: Any) -> None:
        """Check every count, then apply them (what a `stream-rl scale` request does; the autoscaler
        of `launcher.autoscale` too): raises `StreamRLError` with nothing changed on a bad count."""
        self._check(counts)
        try:
            for role, n in counts.items():
                self._scale(role, n, say)
        finally:
            if self._launcher_port is not None:
                self.write_ports(self._launcher_port)

    def _scale(self, role: str, n: int, say: Any) -> None:
        have = self._replicas(role)
        if n == len(have):
            say(f"{role}: {n}, unchanged")
            return
        if n > len(have):
            start = _index(have[-1]) + 1 if have else 0
            for index in range(start, start + n - len(have)):
                self._start(role, index, say)
        else:
            for child in reversed(have[n:]):
                self._stop(child, say)
        say(f"{role}: {len(have)} -> {n}")

    def _start(self, role: str, index: int, say: Any) -> None:
        if role != "server":
            child = self.add_stage(role, index)
            self.spawn(child)
            say(f"started {child.name} (pid {child.proc.pid if child.proc else '-'})")
            return
        from stream_rl.run.servers import join_server

        child = self.add_server(index)
        self.spawn(child)
        url = self.server_url(index)
        transport, names = self._transport()
        try:
            took = join_server(
                transport,
                names,
                url,
                str(self.config.inference.engine),
                JOIN_TIMEOUT_S,
                say=say,
                who="launcher",
                api_key=self.api_key,
            )
        except StreamRLError:
            self._terminate(child)
            self.children.remove(child)
            raise
        self._scaled_servers.add(url)
        say(f"started {child.name} at {url}: it holds the newest version {took or 0:.1f} s after joining")

    def _stop(self, child: Child, say: Any) -> None:
        if child.role == "server":
            from stream_rl.run.servers import leave_server

            url = self.server_url(_index(child))
            transport, names = self._transport()
            leave_server(
                transport, names, url, str(self.config.inference.engine), 120.0, say=say, who="launcher"
            )
            self._scaled_servers.discard(url)
        code = self._terminate(child)
        self.children.remove(child)
        say(f"stopped {child.name} (exit {code})")
        if child.role in ("actor", "verifier", "preprocessor"):
            self._leave_group(child, say)

    def _leave_group(self, child: Child, say: Any) -> None:
        """A stopped replica is a static member that did not leave: remove it, so that its
        partitions are reassigned now (`stream_rl.kafka.members`)."""
        from stream_rl.kafka.members import remove_static_members
        from stream_rl.kafka.topics import TopicNames

        names = TopicNames(run=self.config.run, prefix=self.config.kafka.prefix)
        member = f"{self.config.kafka.prefix}.{self.config.run}.{child.role}.{_index(child)}"
        ok, what = remove_static_members(self.config.kafka, self.bootstrap, names.group(child.role), [member])
        if ok:
            say(f"{child.name}: static member removed from its group: its partitions are reassigned now")
        else:
            say(f"{child.name}: static member kept ({what}): its partitions move when its session expires")

    @staticmethod
    def _terminate(child: Child) -> int | None:
        if child.proc is None or child.proc.poll() is not None:
            return None if child.proc is None else child.proc.returncode
        child.proc.send_signal(signal.SIGTERM)
        try:
            return child.proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            return child.kill_ignoring_sigterm(STOP_GRACE_S)


# -- the command -------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, help="the run's name (its launcher must be running)")
    parser.add_argument("--runs-dir", default="runs")
    parser.add_argument("counts", nargs="+", metavar="ROLE=N", help=f"ROLE one of {', '.join(ROLES)}")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="how long to wait for the launcher's answer (default 600)",
    )


def main(args: argparse.Namespace) -> int:
    from stream_rl.kafka.broker import pid_alive

    counts = parse_counts(args.counts)
    run_dir = Path(args.runs_dir) / args.run
    procs_path = run_dir / "processes.json"
    procs = json.loads(procs_path.read_text()) if procs_path.exists() else {}
    pid = procs.get("launcher_pid")
    if not pid or not pid_alive(int(pid)) or not procs.get("pids"):
        raise StreamRLError(
            f"run {args.run} has no launcher running ({procs_path}): `scale` changes launcher-managed "
            "runs; scale stages started by hand by starting or stopping them (README 'Scaling during a run')"
        )
    request_id = uuid.uuid4().hex
    (run_dir / RESULT).unlink(missing_ok=True)
    _write(run_dir / REQUEST, {"id": request_id, "counts": counts, "pid": os.getpid()})
    deadline = time.monotonic() + args.timeout_s
    while time.monotonic() < deadline:
        try:
            result = json.loads((run_dir / RESULT).read_text())
        except (OSError, ValueError):
            result = None
        if result is not None and result.get("id") == request_id:
            for line in result.get("lines") or []:
                print(line)
            if result.get("error"):
                raise StreamRLError(result["error"])
            return 0
        if not pid_alive(int(pid)):
            raise StreamRLError(f"the launcher of run {args.run} (pid {pid}) exited before answering")
        time.sleep(0.2)
    (run_dir / REQUEST).unlink(missing_ok=True)
    raise StreamRLError(f"no answer from the launcher of run {args.run} within {args.timeout_s:.0f} s")
