"""A nemesis of the project's own (issue 36): faults beyond a clean kill, injected into a running
pipeline and each recorded with its timestamps and the evidence that it happened, in the spirit
of Jepsen's nemeses and Kafka's own system tests. Used by `tests/e2e/test_nemesis.py` (one short
run, each fault once) and `bench/nemesis.py` (an hour at seeded random times on a 3-node cluster).

Faults (each `start()` injects it and returns evidence, `stop()` heals it and returns more):

- `Pause`: SIGSTOP of one process (a broker, the trainer, a server, any stage), SIGCONT at the end;
  evidence: the process's state read back as stopped (`T`).
- `Partition`: every packet dropped (iptables, in a chain of the nemesis's own) on the link
  between a host and the others; either a network namespace's link (`Netns`: the compute host of
  the short test) or a broker's ports on the loopback (`ports=`: one node of a local cluster);
  evidence: a TCP connect across the link fails while it holds and works after.
- `SlowLink`: the link throttled (tc `netem` delay and loss where the kernel has it, else `tbf`
  to a low rate plus a random packet loss with iptables' `statistic` match, or on the shared
  loopback a packet-rate limit and loss on the broker's ports); evidence: the qdisc's and the
  rules' drop counters.
- `DiskFull`: the broker's data directory (a tmpfs mounted for it: `tmpfs()`) filled to the last
  byte, freed at the end; a broker that halted meanwhile (Kafka stops when its only log directory
  fails) is started again by `restart`, as its operator would; evidence: the bytes left (0), and
  whether the broker halted.
- `LostTransactionLog`: a transaction of the nemesis's own left open on every partition of a
  topic, the broker killed (SIGKILL) and started again without its transaction coordinator's log
  (`__transaction_state-*` removed): the data loss that leaves a **hanging transaction** (KIP-664),
  which no marker will ever end and every read_committed reader stops before, until something
  aborts it (the launcher does: `stream_rl/kafka/hanging.py`); evidence: the logs removed, and
  each partition's last stable offset below its log end after the restart.
- `CpuLimit`: a broker's process moved into a cgroup limited to a fraction of one core (cgroup v2
  `cpu.max`, or v1 `cpu.cfs_quota_us` where only v1 is mounted), moved back at the end; evidence:
  the periods it was throttled in.
- `ServerFault`: the built-in server's test-only switch (`stream_rl/inference/fault_hook.py`,
  `$STREAM_RL_SERVER_FAULTS`): every `/v1/*` call answered 500, or accepted and never answered
  (`hang`), until healed; evidence: the calls that met it.

`Events` is the log (JSON lines: wall time, fault, phase `start` / `end` / `recovered`, evidence).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Evidence = dict[str, Any]


def sh(*cmd: str, check: bool = True) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.strip()}")
    return res.stdout


def require_tools(*tools: str) -> None:
    """Each tool on PATH; where one is missing and apt-get is there (a root CI image), install
    iproute2 / iptables first; else fail naming what is missing (never skip)."""
    packages = {"ip": "iproute2", "tc": "iproute2", "iptables": "iptables"}
    missing = [t for t in tools if shutil.which(t) is None]
    if missing and shutil.which("apt-get") and os.geteuid() == 0:
        subprocess.run(["apt-get", "update"], capture_output=True)
        subprocess.run(
            ["apt-get", "install", "-y", *sorted({packages.get(t, t) for t in missing})], capture_output=True
        )
        missing = [t for t in tools if shutil.which(t) is None]
    if missing or os.geteuid() != 0:
        raise AssertionError(f"the nemesis needs root and {', '.join(tools)} (missing: {missing or 'root'})")


class Events:
    """The nemesis's event log: one JSON object a line, `t` the wall time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.events: list[dict[str, Any]] = []

    def add(self, fault: str, phase: str, **detail: Any) -> dict[str, Any]:
        event = {"t": round(time.time(), 3), "fault": fault, "phase": phase, **detail}
        self.events.append(event)
        with open(self.path, "a") as f:
            f.write(json.dumps(event, default=str) + "\n")
        return event


class Fault:
    """One fault: `start()` injects it, `stop()` heals it; both return evidence."""

    kind = "fault"

    def __init__(self, name: str) -> None:
        self.name = name

    def start(self) -> Evidence:
        raise NotImplementedError

    def stop(self) -> Evidence:
        raise NotImplementedError


def child_pid(run_dir: Path, name: str, wait_s: float = 60.0) -> int:
    """The pid of the launcher's child `name` from the run's `processes.json` (waiting out a
    restart: a child is listed again once it runs)."""
    deadline = time.monotonic() + wait_s
    while True:
        pids = json.loads((run_dir / "processes.json").read_text())["pids"]
        if name in pids or time.monotonic() > deadline:
            return int(pids[name])
        time.sleep(0.5)


def proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def dead(pid: int) -> bool:
    try:
        return proc_state(pid) == "Z"
    except FileNotFoundError:
        return True


class Pause(Fault):
    """SIGSTOP of `pid()` (read when the fault starts: a restarted process has a new pid)."""

    kind = "pause"

    def __init__(self, name: str, pid: Callable[[], int]) -> None:
        super().__init__(name)
        self.pid_of = pid
        self.pid = 0

    def start(self) -> Evidence:
        self.pid = self.pid_of()
        os.kill(self.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while (state := proc_state(self.pid)) not in "Tt" and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"pid": self.pid, "state": state}

    def stop(self) -> Evidence:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)
        return {}


class Firewall:
    """A chain of iptables rules of the nemesis's own, jumped to from INPUT and OUTPUT (in a network
    namespace, or the root one where `netns` is None); `close()` removes it all."""

    def __init__(self, name: str, netns: str | None = None) -> None:
        self.chain = name[:28]
        self.prefix = ["ip", "netns", "exec", netns] if netns else []
        self.ipt("-N", self.chain)
        for hook in ("INPUT", "OUTPUT"):
            self.ipt("-I", hook, "-j", self.chain)

    def ipt(self, *args: str, check: bool = True) -> str:
        return sh(*self.prefix, "iptables", "-w", *args, check=check)

    def add(self, *rule: str) -> None:
        self.ipt("-A", self.chain, *rule)

    def flush(self) -> int:
        """Remove every rule; returns the packets they had matched."""
        counted = self.ipt("-L", self.chain, "-v", "-n", "-x", check=False).splitlines()[2:]
        self.ipt("-F", self.chain)
        return sum(int(line.split()[0]) for line in counted if line.split())

    def close(self) -> None:
        for hook in ("INPUT", "OUTPUT"):
            self.ipt("-D", hook, "-j", self.chain, check=False)
        self.ipt("-F", self.chain, check=False)
        self.ipt("-X", self.chain, check=False)


@dataclass
class Netns:
    """A compute host: a network namespace joined to the root one by a veth pair. The root end
    holds `host_addr` (where the broker listens), the namespace's end `addr`; the namespace's
    default route goes through the root end. `close()` deletes it (its veth end goes too)."""

    tag: str
    subnet: int
    name: str = ""
    host_if: str = ""
    ns_if: str = ""

    def __post_init__(self) -> None:
        self.name = f"srlnem{self.tag}"
        self.host_if, self.ns_if = f"vn{self.tag}h", f"vn{self.tag}n"

    @property
    def host_addr(self) -> str:
        return f"10.233.{self.subnet}.1"

    @property
    def addr(self) -> str:
        return f"10.233.{self.subnet}.2"

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def up(self) -> Netns:
        require_tools("ip", "tc", "iptables")
        sh("ip", "netns", "add", self.name)
        try:
            ns = self.prefix()
            sh(*ns, "ip", "link", "set", "lo", "up")
            sh(
                "ip",
                "link",
                "add",
                self.host_if,
                "type",
                "veth",
                "peer",
                "name",
                self.ns_if,
                "netns",
                self.name,
            )
            sh("ip", "addr", "add", f"{self.host_addr}/24", "dev", self.host_if)
            sh("ip", "link", "set", self.host_if, "up")
            sh(*ns, "ip", "addr", "add", f"{self.addr}/24", "dev", self.ns_if)
            sh(*ns, "ip", "link", "set", self.ns_if, "up")
            sh(*ns, "ip", "route", "add", "default", "via", self.host_addr)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)

    def connects(self, addr: str, port: int, timeout_s: float = 2.0) -> bool:
        """A TCP connection from inside the namespace to addr:port succeeds."""
        probe = f"exec 3<>/dev/tcp/{addr}/{port}"
        cmd = [*self.prefix(), "timeout", str(timeout_s), "bash", "-c", probe]
        return subprocess.run(cmd, capture_output=True).returncode == 0


def connects(addr: str, port: int, timeout_s: float = 2.0) -> bool:
    try:
        socket.create_connection((addr, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


class Partition(Fault):
    """Every packet on a link dropped: the namespace's veth (`netns`), or a broker's ports on the
    root namespace's loopback (`ports`, both directions: the node is cut from its peers and the
    clients alike). `probe()` says whether a connection across the link gets through."""

    kind = "partition"

    def __init__(
        self,
        name: str,
        firewall: Firewall,
        *,
        netns: Netns | None = None,
        ports: list[int] | None = None,
        probe: Callable[[], bool],
    ) -> None:
        super().__init__(name)
        self.fw, self.netns, self.ports, self.probe = firewall, netns, ports or [], probe

    def start(self) -> Evidence:
        if self.netns is not None:
            self.fw.add("-i", self.netns.ns_if, "-j", "DROP")
            self.fw.add("-o", self.netns.ns_if, "-j", "DROP")
        for port in self.ports:
            self.fw.add("-i", "lo", "-p", "tcp", "--dport", str(port), "-j", "DROP")
            self.fw.add("-i", "lo", "-p", "tcp", "--sport", str(port), "-j", "DROP")
        return {"connects_during": self.probe()}

    def stop(self) -> Evidence:
        dropped = self.fw.flush()
        return {"packets_dropped": dropped, "connects_after": self.probe()}


def has_netem(netns: Netns) -> bool:
    res = subprocess.run(
        [*netns.prefix(), "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
        capture_output=True,
    )
    if res.returncode == 0:
        subprocess.run([*netns.prefix(), "tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
    return res.returncode == 0


class SlowLink(Fault):
    """The link between the actor's host and the broker throttled: on a namespace's veth, both ends
    shaped (netem `delay_ms` and `loss` where the kernel has netem; else tbf at `rate` with a
    queue of `delay_ms`, plus `loss` dropped at random by iptables); on the root namespace's
    loopback (`ports`: the shared lo must not be shaped), the broker's ports limited to `pps`
    packets a second plus the random loss."""

    kind = "slow-link"

    def __init__(
        self,
        name: str,
        firewall: Firewall,
        *,
        netns: Netns | None = None,
        ports: list[int] | None = None,
        delay_ms: int = 100,
        loss: float = 0.05,
        rate: str = "256kbit",
        pps: int = 200,
    ) -> None:
        super().__init__(name)
        self.fw, self.netns, self.ports = firewall, netns, ports or []
        self.delay_ms, self.loss, self.rate, self.pps = delay_ms, loss, rate, pps
        self.qdisc = ""

    def _links(self) -> list[tuple[list[str], str]]:
        """(command prefix, device) of both ends of the namespace's link."""
        assert self.netns is not None
        return [([], self.netns.host_if), (self.netns.prefix(), self.netns.ns_if)]

    def start(self) -> Evidence:
        chance = ("-m", "statistic", "--mode", "random", "--probability", str(self.loss), "-j", "DROP")
        if self.netns is not None:
            netem = has_netem(self.netns)
            self.qdisc = "netem" if netem else "tbf"
            for prefix, dev in self._links():
                cmd = [*prefix, "tc", "qdisc", "add", "dev", dev, "root"]
                if netem:
                    sh(*cmd, "netem", "delay", f"{self.delay_ms}ms", "loss", f"{self.loss * 100:g}%")
                else:
                    sh(*cmd, "tbf", "rate", self.rate, "burst", "4kb", "latency", f"{self.delay_ms}ms")
            if not netem:
                self.fw.add("-i", self.netns.ns_if, *chance)
                self.fw.add("-o", self.netns.ns_if, *chance)
        for port in self.ports:
            limit = ("-m", "hashlimit", "--hashlimit-above", f"{self.pps}/sec", "--hashlimit-burst", "20")
            self.fw.add(
                "-i",
                "lo",
                "-p",
                "tcp",
                "--dport",
                str(port),
                *limit,
                "--hashlimit-name",
                f"srl{port}",
                "-j",
                "DROP",
            )
            self.fw.add("-i", "lo", "-p", "tcp", "--dport", str(port), *chance)
        return {"qdisc": self.qdisc or "iptables", "loss": self.loss}

    def stop(self) -> Evidence:
        out: Evidence = {"packets_dropped": self.fw.flush()}
        if self.netns is not None:
            stats = []
            for prefix, dev in self._links():
                stats.append(sh(*prefix, "tc", "-s", "qdisc", "show", "dev", dev))
                sh(*prefix, "tc", "qdisc", "del", "dev", dev, "root")
            sent = [line for text in stats for line in text.splitlines() if "Sent" in line]
            out["qdisc_stats"] = sent
            out["qdisc_dropped_or_overlimits"] = sum(
                int(line.split("dropped ")[1].split(",")[0]) + int(line.split("overlimits ")[1].split()[0])
                for line in sent
            )
        return out


@contextlib.contextmanager
def tmpfs(path: Path, size_mb: int) -> Iterator[Path]:
    """A tmpfs of `size_mb` mounted at `path` for the block (the broker's data directory)."""
    path.mkdir(parents=True, exist_ok=True)
    sh("mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path))
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


class DiskFull(Fault):
    """`mount` filled to the last byte (a file of zeros, then single bytes until ENOSPC), the file
    removed at the end; `alive()` false then (the broker halted on its failed log directory):
    `restart()` starts it again."""

    kind = "disk-full"

    def __init__(
        self, name: str, mount: Path, alive: Callable[[], bool], restart: Callable[[], None]
    ) -> None:
        super().__init__(name)
        self.mount, self.alive, self.restart = mount, alive, restart
        self.fill = mount / "nemesis-fill"

    def start(self) -> Evidence:
        fd = os.open(self.fill, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            for chunk in (1 << 20, 4096, 1):
                with contextlib.suppress(OSError):
                    while True:
                        os.write(fd, b"\0" * chunk)
        finally:
            os.close(fd)
        st = os.statvfs(self.mount)
        return {"bytes_free": st.f_bavail * st.f_frsize, "filled_bytes": self.fill.stat().st_size}

    def stop(self) -> Evidence:
        alive = self.alive()
        self.fill.unlink()
        out: Evidence = {"broker_alive_at_end": alive}
        if not alive:
            started = time.monotonic()
            self.restart()
            out["restart_s"] = round(time.monotonic() - started, 1)
        return out


class LostTransactionLog(Fault):
    """A transaction open on every partition of `topic` (one record each, a producer of the
    nemesis's own with `transactional_id`), then the broker killed (`pid()`, SIGKILL) and its
    transaction coordinator's log removed from `logs` (its `kraft-logs`); `restart()` at the end
    starts it again without that log. No coordinator knows the transaction any more: it hangs."""

    kind = "lost-txn-log"

    def __init__(
        self,
        name: str,
        bootstrap: str,
        topic: str,
        transactional_id: str,
        pid: Callable[[], int],
        logs: Path,
        restart: Callable[[], None],
    ) -> None:
        super().__init__(name)
        self.bootstrap, self.topic, self.transactional_id = bootstrap, topic, transactional_id
        self.pid_of, self.logs, self.restart = pid, logs, restart
        self.producer: Any = None

    def _ends(self) -> dict[int, tuple[int, int]]:
        """Each partition's (last stable offset, log end), once its leader answers (a restarted
        broker answers UNKNOWN_LEADER_EPOCH until it has caught up with its metadata)."""
        import confluent_kafka as ck
        from confluent_kafka.admin import AdminClient, OffsetSpec

        admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})
        parts = admin.list_topics(self.topic, timeout=30).topics[self.topic].partitions
        tps = [ck.TopicPartition(self.topic, p) for p in sorted(parts)]
        deadline = time.monotonic() + 60
        while True:
            try:
                ends = [
                    {tp.partition: f.result().offset for tp, f in admin.list_offsets(
                        {tp: OffsetSpec.latest() for tp in tps}, isolation_level=level, request_timeout=10
                    ).items()}
                    for level in (ck.IsolationLevel.READ_COMMITTED, ck.IsolationLevel.READ_UNCOMMITTED)
                ]  # fmt: skip
                return {p: (ends[0][p], ends[1][p]) for p in ends[1]}
            except ck.KafkaException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def start(self) -> Evidence:
        import confluent_kafka as ck

        producer = ck.Producer(
            {"bootstrap.servers": self.bootstrap, "transactional.id": self.transactional_id, "log_level": 0}
        )
        producer.init_transactions(30)
        producer.begin_transaction()
        parts = sorted(producer.list_topics(self.topic, timeout=30).topics[self.topic].partitions)
        for p in parts:
            producer.produce(self.topic, b"never decided: the nemesis's hanging transaction", partition=p)
        if producer.flush(30):
            raise OSError("the nemesis's records were not acknowledged")
        self.producer = producer  # kept, never ended: its coordinator is about to forget it
        pid = self.pid_of()
        os.kill(pid, signal.SIGKILL)
        removed = sorted(path.name for path in self.logs.glob("__transaction_state-*"))
        deadline = time.monotonic() + 30
        while not dead(pid):  # gone, or a zombie: it writes nothing more
            if time.monotonic() > deadline:
                raise AssertionError(f"the broker (pid {pid}) still runs 30 s after SIGKILL")
            time.sleep(0.05)
        for name in removed:
            shutil.rmtree(self.logs / name)
        return {"pid": pid, "open_partitions": len(parts), "removed": removed}

    def stop(self) -> Evidence:
        started = time.monotonic()
        self.restart()
        out: Evidence = {"restart_s": round(time.monotonic() - started, 1)}
        ends = self._ends()
        out["undecided"] = {p: list(e) for p, e in ends.items() if e[0] < e[1]}
        out["partitions"] = len(ends)
        return out


class CpuLimit(Fault):
    """`pid()` limited to `fraction` of one core: moved into a cgroup of its own with that quota
    (v2 `cpu.max` where the unified hierarchy has the cpu controller, else v1's cpu controller),
    moved back to the root group at the end."""

    kind = "cpu-limit"
    PERIOD_US = 100_000

    def __init__(self, name: str, pid: Callable[[], int], fraction: float, group: str) -> None:
        super().__init__(name)
        self.pid_of, self.fraction, self.group = pid, fraction, group
        self.pid = 0
        v2 = Path("/sys/fs/cgroup/cgroup.controllers")
        self.v2 = v2.is_file() and "cpu" in v2.read_text().split()
        self.root = Path("/sys/fs/cgroup") if self.v2 else Path("/sys/fs/cgroup/cpu")
        if not (self.root / "cgroup.procs").is_file():
            raise AssertionError("no cgroup cpu controller mounted (v2 cpu.max or v1 cpu)")
        self.dir = self.root / group

    def start(self) -> Evidence:
        self.pid = self.pid_of()
        self.dir.mkdir(exist_ok=True)
        quota = int(self.PERIOD_US * self.fraction)
        if self.v2:
            (self.dir / "cpu.max").write_text(f"{quota} {self.PERIOD_US}")
        else:
            (self.dir / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
            (self.dir / "cpu.cfs_quota_us").write_text(str(quota))
        (self.dir / "cgroup.procs").write_text(str(self.pid))
        return {"pid": self.pid, "cgroup": "v2" if self.v2 else "v1", "fraction": self.fraction}

    def stop(self) -> Evidence:
        stat = dict(line.split() for line in (self.dir / "cpu.stat").read_text().splitlines() if line.strip())
        self.close()
        return {"nr_throttled": int(stat.get("nr_throttled", 0)), "throttled_s": self._throttled(stat)}

    @staticmethod
    def _throttled(stat: dict[str, str]) -> float:
        if "throttled_usec" in stat:
            return int(stat["throttled_usec"]) / 1e6
        return int(stat.get("throttled_time", 0)) / 1e9

    def close(self) -> None:
        if not self.dir.is_dir():
            return
        for pid in (self.dir / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (self.root / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            self.dir.rmdir()


class ServerFault(Fault):
    """The built-in server's fault switch (`STREAM_RL_SERVER_FAULTS` names `switch`): `mode` is
    `500` or `hang`."""

    kind = "server"

    def __init__(self, name: str, switch: Path, mode: str) -> None:
        super().__init__(name)
        self.switch, self.mode = switch, mode
        self.kind = f"server-{mode}"

    def met(self) -> int:
        counts = self.switch.with_name(self.switch.name + ".count")
        with contextlib.suppress(OSError):
            return dict(line.split() for line in counts.read_text().splitlines()).get(self.mode, 0)  # type: ignore[return-value]
        return 0

    def start(self) -> Evidence:
        self.before = int(self.met())
        self.switch.write_text(self.mode)
        return {}

    def stop(self) -> Evidence:
        self.switch.write_text("")
        return {"calls_met": int(self.met()) - self.before}


@dataclass
class Step:
    """One fault of a plan, held `seconds`; recovery expected within `recover_s` of its end."""

    fault: Fault
    seconds: float
    recover_s: float
    before_s: float = 0.0
    """Held (the run going on) before the fault starts."""
    result: dict[str, Any] = field(default_factory=dict)


class Nemesis:
    """Runs a plan against a run whose progress `version()` reads (the newest weight version, -1
    before the first): each step starts once the run made `gap_versions` versions since the last
    recovery (or the start), holds its fault, heals it, then waits for the next version: the
    recovery, in seconds from the heal's start (a full disk's includes the broker's restart).
    Everything goes to `events`."""

    def __init__(self, events: Events, version: Callable[[], int], done: Callable[[], bool]) -> None:
        self.events, self.version, self.done = events, version, done

    def wait_version(self, above: int, within_s: float) -> int | None:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline and not self.done():
            if (v := self.version()) > above:
                return v
        return None

    def hold(self, seconds: float) -> None:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            self.version()  # keeps reading (a watch consumes its topic as it goes)

    def run(self, plan: list[Step], gap_versions: int = 1, first_version: int = 1) -> list[Step]:
        """Each step once the run holds `first_version`, then `gap_versions` after the previous
        step's recovery; stops early when the run ends or a step does not recover."""
        at = self.wait_version(first_version - 1, 600)
        for step in plan:
            if at is None or self.done():
                break
            self.hold(step.before_s)
            if self.done():
                break
            f = step.fault
            try:
                evidence = f.start()
            except (OSError, KeyError, ValueError, AssertionError) as exc:  # e.g. its process restarting
                with contextlib.suppress(Exception):
                    f.stop()
                self.events.add(f.name, "skipped", kind=f.kind, error=f"{type(exc).__name__}: {exc}")
                continue
            start = self.events.add(f.name, "start", kind=f.kind, version=self.version(), **evidence)
            try:
                self.hold(step.seconds)
            finally:
                healed = time.time()  # stop() can take a while: a halted broker is started again
                evidence = f.stop()
                end = self.events.add(
                    f.name, "end", kind=f.kind, healing_s=round(time.time() - healed, 1), **evidence
                )
            held = self.version()
            at = self.wait_version(held, step.recover_s)
            recovered = round(time.time() - healed, 1) if at is not None else None
            self.events.add(f.name, "recovered", kind=f.kind, version=at, seconds=recovered)
            step.result = {"start": start, "end": end, "recovered_s": recovered, "version": at}
            if at is not None and gap_versions > 1:
                at = self.wait_version(at + gap_versions - 2, 600)
        return plan


def seeded_seconds(rng: random.Random, low: float, high: float) -> float:
    return round(rng.uniform(low, high), 1)
