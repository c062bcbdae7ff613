"""A real Apache Kafka broker without Docker: jars from Maven Central, KRaft, one process.

    stream-rl kafka up [--data-dir D] [--port P]   fetch jars (once), format (once), start, wait
    stream-rl kafka status                          pid, port, answering or not
    stream-rl kafka down                            SIGTERM, wait, report

The jars live in `~/.cache/stream-rl/kafka-<version>/lib` (Maven's own cache is ~/.m2). The
data dir holds the KRaft logs, `server.properties`, `broker.log` and `broker.json` (pid and
ports); data survives down/up, which replay depends on.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from stream_rl.common.ports import free_port, port_frees, port_is_free
from stream_rl.errors import BrokerError
from stream_rl.kafka.class_archive import ClassArchive
from stream_rl.kafka.listener import Listener, SaslSslListener

KAFKA_VERSION = "4.3.1"
DEPLOY_DIR = Path(__file__).resolve().parents[2] / "deploy" / "kafka"
JVM_OPTS = [
    # Sized for a 2-core, shared machine: G1 with Kafka's own pause target.
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
    "-Djava.awt.headless=true",
]
BROKER_HEAP = ["-Xms512m", "-Xmx512m", "-XX:+AlwaysPreTouch"]
"""The broker's heap: fixed (-Xms = -Xmx, as Kafka's own start script sets it) and touched at start,
so the broker takes its memory in its first second and its RSS cannot creep over a run (a heap
G1 could grow from 256 to 768 MiB grew the broker's RSS ~5 MiB/min through a 16-minute soak)."""
BROKER_JIT = ["-XX:TieredStopAtLevel=1"]
"""The broker's JIT: C1 only. With the fixed heap, what still grew was the JIT's (Native Memory
Tracking over 8.5 minutes of a soak: code cache +4.2 MB, C2's compiler arenas +5.5 MB; 0.9 MiB/min
in all), as C2 went on recompiling hot methods for many minutes. C1 compiles each method once, soon
after start, and has no C2 arenas; the broker's share of a run's CPU is in docs/performance.md "Memory over a
run". `MALLOC_ARENA_MAX=2` (`_broker_env`) keeps glibc from holding per-thread arenas' freed memory."""
BROKER_NIO = ["-Djdk.nio.maxCachedBufferSize=262144"]
"""The JDK caches, per thread, a temporary direct buffer as large as the largest socket or file I/O
that thread did with a heap buffer, and keeps it: the broker's RSS grew in steps each time a record
larger than before passed one of its threads (0.37 MiB/min over a soak, in steps; a probe under
Native Memory Tracking: NMT's direct memory 0.2 -> 19.3 MiB after 4 MB records, then flat; with this
cap at 256 KiB, flat at 1.2 MiB and RSS 13.7 MiB lower; docs/faults.md). Larger I/O gets a buffer
freed after use."""
READY_TIMEOUT_S = 60.0


def _broker_env() -> dict[str, str]:
    # A fixed mmap threshold: glibc otherwise raises it after freeing a large block, so the buffers
    # above BROKER_NIO's cap (MBs, allocated and freed per large record) then come from the arena
    # and its memory stays (the probe of BROKER_NIO: RSS growth 14.4 -> 7.3 MiB with this).
    return {
        **os.environ,
        "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", "2"),
        "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", "262144"),
    }


def cache_root() -> Path:
    return Path(os.environ.get("STREAM_RL_CACHE", Path.home() / ".cache" / "stream-rl"))


def jars_dir(version: str = KAFKA_VERSION) -> Path:
    return cache_root() / f"kafka-{version}" / "lib"


def _require_tool(name: str, hint: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise BrokerError(f"{name} not found on PATH: {hint}")
    return path


def fetch_jars(version: str = KAFKA_VERSION, quiet: bool = False) -> Path:
    """Download the broker's runtime jars with Maven into the cache (once)."""
    lib = jars_dir(version)
    if (lib / ".complete").exists():
        return lib
    mvn = _require_tool(
        "mvn", "install Maven 3 (e.g. `apt-get install maven`); it fetches Kafka from Maven Central"
    )
    _require_tool("java", "install a JDK 17+ (e.g. `apt-get install openjdk-17-jdk-headless`)")
    work = lib.parent
    work.mkdir(parents=True, exist_ok=True)
    shutil.copy(DEPLOY_DIR / "pom.xml", work / "pom.xml")
    tmp = work / "lib.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    if not quiet:
        print(f"fetching Apache Kafka {version} from Maven Central into {lib} ...", flush=True)
    cmd = [
        mvn,
        "-B",
        "-q",
        "-f",
        str(work / "pom.xml"),
        "dependency:copy-dependencies",
        f"-DoutputDirectory={tmp}",
        "-DincludeScope=runtime",
        f"-Dkafka.version={version}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise BrokerError(f"Maven could not fetch Kafka {version} (exit {proc.returncode}):\n{tail}")
    if not any(tmp.glob("kafka_2.13-*.jar")):
        raise BrokerError(f"Maven finished but no kafka_2.13 jar is in {tmp}")
    shutil.rmtree(lib, ignore_errors=True)
    tmp.rename(lib)
    (lib / ".complete").touch()
    return lib


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child counts as dead.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def _answers(bootstrap: str, timeout: float = 2.0, properties: dict[str, str] | None = None) -> bool:
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    # log_level 0: connection-refused noise is expected while the broker starts.
    admin = AdminClient(
        {
            "bootstrap.servers": bootstrap,
            "socket.connection.setup.timeout.ms": 2000,
            "log_level": 0,
            **(properties or {}),
        }
    )
    try:
        return bool(admin.list_topics(timeout=timeout).brokers)
    except KafkaException:
        return False


@dataclass(frozen=True)
class Quorum:
    """This broker's place in a multi-node KRaft cluster (`stream_rl/kafka/cluster.py`): every node
    is broker and controller, the voters are static, the internal topics replicated."""

    node_id: int
    controller_port: int
    voters: str
    """`controller.quorum.voters`: `1@127.0.0.1:P1,2@127.0.0.1:P2,...`."""
    cluster_id: str
    replication: int
    """Replication factor of the internal topics (offsets, transaction state)."""

    def overrides(self) -> dict[str, str]:
        isr = str(min(2, self.replication))
        rf = str(self.replication)
        return {
            "node.id": str(self.node_id),
            "controller.quorum.bootstrap.servers": "",
            "controller.quorum.voters": self.voters,
            "offsets.topic.replication.factor": rf,
            "transaction.state.log.replication.factor": rf,
            "transaction.state.log.min.isr": isr,
            "share.coordinator.state.topic.replication.factor": rf,
            "share.coordinator.state.topic.min.isr": isr,
        }


@dataclass
class BrokerState:
    pid: int
    port: int
    controller_port: int
    host: str
    version: str
    started_at: float
    class_archive: str = ""
    """The file this broker dumps its classes into at exit (`ClassArchive`), "" if none."""

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"


class LocalBroker:
    """One local KRaft broker rooted at `data_dir`."""

    def __init__(
        self,
        data_dir: str | Path = ".kafka",
        port: int = 9092,
        host: str = "127.0.0.1",
        version: str = KAFKA_VERSION,
        listener: Listener | None = None,
        quorum: Quorum | None = None,
        log_config: Path | None = None,
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.port = port
        self.host = host
        self.version = version
        self.listener = listener
        """A SASL_SSL client listener besides the PLAINTEXT one (`stream_rl/kafka/listener.py`), or
        the secured broker's listeners, which replace it (`stream_rl/kafka/secure.py`)."""
        self.quorum = quorum
        """Set for a node of a multi-node cluster (`LocalCluster`); None: a standalone broker."""
        self.log_config = log_config
        """A log4j2 file laid over deploy/kafka/log4j2.properties (e.g. a logger at INFO)."""

    @property
    def state_file(self) -> Path:
        return self.data_dir / "broker.json"

    @property
    def log_file(self) -> Path:
        return self.data_dir / "broker.log"

    def state(self) -> BrokerState | None:
        try:
            return BrokerState(**json.loads(self.state_file.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def running(self) -> BrokerState | None:
        st = self.state()
        return st if st is not None and pid_alive(st.pid) else None

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _write_config(self, controller_port: int) -> Path:
        template = (DEPLOY_DIR / "server.properties.template").read_text()
        props = template.format(
            host=self.host,
            advertised_host=self.host,
            port=self.port,
            controller_port=controller_port,
            log_dir=self.data_dir / "kraft-logs",
        )
        if isinstance(self.listener, SaslSslListener):
            props = _with_listener(props, self.listener, self.host, self.port, controller_port)
        elif self.listener is not None:
            props = _override(props, self.listener.overrides(self.host, self.port, controller_port))
        if self.quorum is not None:
            props = _override(props, self.quorum.overrides())
        path = self.data_dir / "server.properties"
        path.write_text(props)
        if self.listener is not None:
            path.chmod(0o600)  # it holds the SASL users' passwords and the keystore's
        return path

    def _probe_properties(self) -> dict[str, str]:
        """What the readiness probe connects with: nothing on the PLAINTEXT port, the operator's
        credentials on a secured broker's."""
        return self.listener.probe_properties() if self.listener is not None else {}

    def _java(self) -> list[str]:
        java = _require_tool("java", "install a JDK 17+ (e.g. `apt-get install openjdk-17-jdk-headless`)")
        log4j = ",".join(str(p) for p in (DEPLOY_DIR / "log4j2.properties", self.log_config) if p)
        return [java, *JVM_OPTS, f"-Dlog4j2.configurationFile={log4j}", "-cp", f"{jars_dir(self.version)}/*"]

    def _archive(self) -> ClassArchive:
        return ClassArchive(jars_dir(self.version).parent / "cds", self._java()[0])

    def up(self, quiet: bool = False, wait: bool = True) -> BrokerState:
        """Start the broker (fetching and formatting first if needed); a no-op if it runs.
        `wait=False` returns once the process is started (a cluster's node cannot answer before
        a quorum of its peers runs)."""
        st = self.running()
        if st is not None:
            if _answers(st.bootstrap, properties=self._probe_properties()):
                if not quiet:
                    print(f"Kafka already running (pid {st.pid}) at {st.bootstrap}")
                return st
            raise BrokerError(
                f"a broker process (pid {st.pid}) exists but {st.bootstrap} does not answer; "
                f"see {self.log_file} or run `stream-rl kafka down`"
            )
        fetch_jars(self.version, quiet=quiet)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not port_frees(self.port, self.host):
            raise BrokerError(f"port {self.port} is taken by another process; choose another with --port")
        for port, what in self.listener.extra_ports() if self.listener is not None else ():
            if not port_is_free(port, self.host):
                raise BrokerError(f"port {port} (the {what} listener's) is taken by another process")
        old = self.state()
        controller_port = (
            self.quorum.controller_port if self.quorum else old.controller_port if old else free_port()
        )
        if not port_is_free(controller_port):
            raise BrokerError(f"controller port {controller_port} (recorded in {self.state_file}) is taken")
        config = self._write_config(controller_port)
        archive = self._archive()
        started = time.monotonic()
        if not (self.data_dir / "kraft-logs" / "meta.properties").exists():
            cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
            # A cluster's nodes share its id and name their voters statically; one broker is a
            # standalone (dynamic) quorum of itself.
            quorum = ["--standalone"] if self.quorum is None else []
            if self.quorum is not None:
                cluster_id = self.quorum.cluster_id
            fmt = subprocess.run(
                [
                    *self._java(),
                    *archive.use(),
                    "-Xmx256m",
                    "kafka.tools.StorageTool",
                    "format",
                    *quorum,
                    # `=`: a base64 id may start with "-", which argparse4j would take for an option.
                    f"--cluster-id={cluster_id}",
                    *(self.listener.format_args() if self.listener is not None else []),
                    "-c",
                    str(config),
                ],
                capture_output=True,
                text=True,
            )
            if fmt.returncode != 0:
                raise BrokerError(f"formatting KRaft storage failed:\n{fmt.stdout}{fmt.stderr}")
        archive_flags, dump = archive.use_or_make()
        with open(self.log_file, "ab") as logf:
            proc = subprocess.Popen(
                [
                    *self._java(),
                    *BROKER_HEAP,
                    *BROKER_JIT,
                    *BROKER_NIO,
                    *archive_flags,
                    "kafka.Kafka",
                    str(config),
                ],
                env=_broker_env(),
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        st = BrokerState(
            pid=proc.pid,
            port=self.port,
            controller_port=controller_port,
            # With a SASL_SSL listener on `host`, the PLAINTEXT one (the broker's own) is on loopback.
            host="127.0.0.1" if isinstance(self.listener, SaslSslListener) else self.host,
            version=self.version,
            started_at=time.time(),
            class_archive=dump,
        )
        self.state_file.write_text(json.dumps(asdict(st)))
        if not wait:
            return st
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _answers(st.bootstrap, timeout=1.0, properties=self._probe_properties()):
            if proc.poll() is not None:
                raise BrokerError(
                    f"Kafka exited with code {proc.returncode} while starting; "
                    f"last lines of {self.log_file}:\n{self._log_tail()}"
                )
            if time.monotonic() > deadline:
                self.down(quiet=True)
                raise BrokerError(
                    f"Kafka did not answer within {READY_TIMEOUT_S:.0f}s; "
                    f"last lines of {self.log_file}:\n{self._log_tail()}"
                )
            time.sleep(0.2)
        if not quiet:
            print(
                f"Kafka {self.version} up at {st.bootstrap} (pid {st.pid}, "
                f"{time.monotonic() - started:.1f}s, data in {self.data_dir})"
            )
        return st

    def down(self, quiet: bool = False, timeout: float = 30.0) -> bool:
        """SIGTERM the broker and wait; SIGKILL after `timeout`. Returns whether one was running."""
        st = self.running()
        if st is None:
            if not quiet:
                print(f"no Kafka broker running from {self.data_dir}")
            return False
        os.kill(st.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while pid_alive(st.pid) and time.monotonic() < deadline:
            _reap(st.pid)
            time.sleep(0.1)
        how = "stopped"
        if pid_alive(st.pid):
            os.kill(st.pid, signal.SIGKILL)
            _reap(st.pid)
            how = f"killed (did not stop within {timeout:.0f}s of SIGTERM)"
        if st.class_archive:
            self._archive().finish(st.class_archive, stopped_cleanly=how == "stopped")
        if not quiet:
            print(f"Kafka (pid {st.pid}) {how}; data kept in {self.data_dir}")
        return True

    def status(self) -> str:
        st = self.state()
        if st is None:
            return f"no broker has run from {self.data_dir}"
        if not pid_alive(st.pid):
            return f"stopped (last ran as pid {st.pid} at {st.bootstrap}); data in {self.data_dir}"
        answering = (
            "answering" if _answers(st.bootstrap, properties=self._probe_properties()) else "NOT answering"
        )
        return f"running: pid {st.pid} at {st.bootstrap}, {answering}; Kafka {st.version}; data in {self.data_dir}"


def _with_listener(props: str, listener: SaslSslListener, host: str, port: int, controller_port: int) -> str:
    """The template's properties with a SASL_SSL listener added (its keys replace the template's)."""
    controller = f"CONTROLLER://127.0.0.1:{controller_port}"
    overrides = {
        "listeners": f"PLAINTEXT://127.0.0.1:{port},SASL_SSL://{host}:{listener.port},{controller}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port},SASL_SSL://{host}:{listener.port},{controller}",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,SASL_SSL:SASL_SSL",
        **listener.server_properties(host),
    }
    return _override(props, overrides)


def _override(props: str, overrides: dict[str, str]) -> str:
    """`props` with the keys of `overrides` replaced (an empty value drops the key)."""
    lines = [ln for ln in props.splitlines() if ln.split("=", 1)[0] not in overrides]
    return "\n".join([*lines, *(f"{k}={v}" for k, v in overrides.items() if v)]) + "\n"


def _reap(pid: int) -> None:
    """Collect our own exited child (no-op for other processes)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def resolve_bootstrap(
    explicit: str | None = None, configured: str | None = None, data_dir: str | Path = ".kafka"
) -> str:
    """Bootstrap address: --bootstrap, then the config, then $STREAM_RL_KAFKA_BOOTSTRAP, then the
    local cluster or broker recorded in `data_dir`, then 127.0.0.1:9092."""
    if explicit:
        return explicit
    if configured:
        return configured
    env = os.environ.get("STREAM_RL_KAFKA_BOOTSTRAP")
    if env:
        return env
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # a local cluster (cluster.py)
        ports = json.loads((Path(data_dir) / "cluster.json").read_text())["ports"]
        return ",".join(f"127.0.0.1:{p}" for p in ports)
    st = LocalBroker(data_dir).state()
    return st.bootstrap if st is not None else "127.0.0.1:9092"
