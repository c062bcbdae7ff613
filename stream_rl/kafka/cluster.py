"""A local multi-node KRaft cluster from the same jars: `stream-rl kafka up --brokers 3`.

Every node is broker and controller (static voters), with its own data dir `<data_dir>/node-<i>`
and ports; `<data_dir>/cluster.json` records the ports and the cluster id, so `down`, `status` and
a later `up` find the same cluster (its data survives down/up, as a single broker's does). The
internal topics (offsets, transaction state) are replicated min(3, N) times with min ISR
min(2, N); the run's topics get what `kafka.replication_factor` / `min_insync_replicas` say.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from stream_rl.common.ports import free_port, port_is_free
from stream_rl.errors import BrokerError
from stream_rl.kafka.broker import READY_TIMEOUT_S, LocalBroker, Quorum, _answers
from stream_rl.kafka.secure import SecureListeners, secure_listeners

STATE = "cluster.json"


@dataclass(frozen=True)
class ClusterLayout:
    ports: list[int]
    controller_ports: list[int]
    cluster_id: str

    @property
    def bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{p}" for p in self.ports)


def cluster_layout(data_dir: str | Path) -> ClusterLayout | None:
    """The layout recorded in `data_dir` (None: no cluster was made there)."""
    try:
        return ClusterLayout(**json.loads((Path(data_dir) / STATE).read_text()))
    except (OSError, ValueError, TypeError):
        return None


class LocalCluster:
    """`brokers` local KRaft nodes rooted at `data_dir`, clients on `port`, `port + 1`, ..."""

    def __init__(
        self,
        data_dir: str | Path = ".kafka",
        brokers: int = 3,
        port: int = 9092,
        ports: list[int] | None = None,
        secure: SecureListeners | None = None,
    ) -> None:
        """`ports` (one per broker) replaces `port, port + 1, ...`; a recorded layout wins over both.
        `secure`: every node's secured listeners (`kafka up --secure --brokers N`); by default those
        recorded in the data dir, if any."""
        self.data_dir = Path(data_dir).resolve()
        self.secure = secure or secure_listeners(self.data_dir)
        layout = cluster_layout(self.data_dir)
        if layout is not None and len(layout.ports) != brokers:
            raise BrokerError(
                f"{self.data_dir} holds a {len(layout.ports)}-broker cluster; use --brokers "
                f"{len(layout.ports)} or another --data-dir"
            )
        clients = ports or [port + i for i in range(brokers)]
        controllers: list[int] = []
        while len(controllers) < brokers:  # free, and none of the client ports
            candidate = free_port()
            if candidate not in clients and candidate not in controllers:
                controllers.append(candidate)
        self.layout = layout or ClusterLayout(
            ports=clients,
            controller_ports=controllers,
            cluster_id=base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("="),
        )

    @property
    def bootstrap(self) -> str:
        return self.layout.bootstrap

    def node(self, i: int) -> LocalBroker:
        """Node `i` (0-based; its KRaft node id is i + 1)."""
        lay = self.layout
        voters = ",".join(f"{n + 1}@127.0.0.1:{p}" for n, p in enumerate(lay.controller_ports))
        quorum = Quorum(
            node_id=i + 1,
            controller_port=lay.controller_ports[i],
            voters=voters,
            cluster_id=lay.cluster_id,
            replication=min(3, len(lay.ports)),
        )
        listener = self.secure.node(i) if self.secure is not None else None
        host = listener.ports.host if listener is not None else "127.0.0.1"
        return LocalBroker(
            self.data_dir / f"node-{i}", port=lay.ports[i], host=host, listener=listener, quorum=quorum
        )

    def nodes(self) -> list[LocalBroker]:
        return [self.node(i) for i in range(len(self.layout.ports))]

    def up(self, quiet: bool = False, timeout: float = READY_TIMEOUT_S) -> str:
        """Start every node that is not running, wait until all answer; returns the bootstrap."""
        nodes = self.nodes()
        for node in nodes:
            if node.running() is None and not port_is_free(node.port):
                raise BrokerError(f"port {node.port} is taken by another process; choose another with --port")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / STATE).write_text(json.dumps(self.layout.__dict__))
        started = time.monotonic()
        for node in nodes:
            if node.running() is None:
                node.up(quiet=True, wait=False)
        self.wait(timeout)
        if not quiet:
            print(
                f"Kafka cluster of {len(nodes)} up at {self.bootstrap} ({time.monotonic() - started:.1f}s, "
                f"data in {self.data_dir})"
            )
        return self.bootstrap

    def wait(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Until every node answers; BrokerError naming the first that does not (and its log)."""
        deadline = time.monotonic() + timeout
        for node in self.nodes():
            while not _answers(f"{node.host}:{node.port}", timeout=1.0, properties=node._probe_properties()):
                if node.running() is None:
                    raise BrokerError(f"node {node.data_dir.name} exited while starting:\n{node._log_tail()}")
                if time.monotonic() > deadline:
                    raise BrokerError(
                        f"node {node.data_dir.name} did not answer within {timeout:.0f}s:\n{node._log_tail()}"
                    )
                time.sleep(0.3)

    def down(self, quiet: bool = False) -> int:
        """Stop every node; returns how many were running."""
        nodes = self.nodes()
        # SIGTERM all at once: one by one, the last nodes would wait for a quorum that left.
        for node in nodes:
            st = node.running()
            if st is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(st.pid, signal.SIGTERM)
        stopped = sum(node.down(quiet=True) for node in nodes)
        if not quiet:
            print(f"{stopped} of {len(self.layout.ports)} Kafka nodes stopped; data kept in {self.data_dir}")
        return stopped

    def status(self) -> str:
        return "\n".join(f"{node.data_dir.name}: {node.status()}" for node in self.nodes())
