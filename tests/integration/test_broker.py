"""The local broker's lifecycle: data survives down/up; clear errors."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest
from fakes.records import make_problem

from stream_rl.common.ports import free_port
from stream_rl.errors import BrokerError
from stream_rl.kafka.broker import LocalBroker
from stream_rl.kafka.class_archive import ClassArchive
from stream_rl.kafka.confluent import KafkaTransport
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.topics import PROBLEMS, TopicNames, apply_topics

pytestmark = pytest.mark.integration


def test_down_then_up_keeps_topics_and_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Also the class archive: the first broker (none yet, an archive dir of the test's own) dumps
    its classes when it stops, the second maps that archive."""
    archive = ClassArchive(tmp_path / "cds", shutil.which("java") or "java")
    monkeypatch.setattr(LocalBroker, "_archive", lambda self: archive)
    broker = LocalBroker(tmp_path / "k", port=free_port())
    st = broker.up(quiet=True)
    assert st.class_archive and not archive.path.exists()
    try:
        assert broker.up(quiet=True).pid == st.pid  # a second `up` is a no-op
        kafka = KafkaTransport(st.bootstrap)
        names = TopicNames(run="keep")
        apply_topics(kafka, names)
        p = kafka.producer("t")
        for i in range(5):
            p.produce(names[PROBLEMS], default_serde().encode(make_problem(i)), key=str(i))
        p.flush()
        assert broker.down(quiet=True)
        assert "stopped" in broker.status()
        assert archive.path.exists() and not list(archive.directory.glob("*.tmp"))
        st2 = broker.up(quiet=True)
        assert st2.pid != st.pid and st2.class_archive == ""
        assert str(archive.path) in Path(f"/proc/{st2.pid}/maps").read_text()  # the JVM mapped it
        kafka = KafkaTransport(st2.bootstrap)
        assert names[PROBLEMS] in kafka.list_topic_names()
        assert sum(h - lo for lo, h in kafka.watermarks(names[PROBLEMS]).values()) == 5
    finally:
        broker.down(quiet=True)
    assert not broker.down(quiet=True)


def test_taken_port_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(BrokerError, match=f"port {port} is taken"):
            LocalBroker(tmp_path / "k", port=port).up(quiet=True)


def test_broker_dying_at_start_shows_its_log(tmp_path: Path) -> None:
    data = tmp_path / "k"
    (data / "kraft-logs").mkdir(parents=True)
    # A storage directory that claims to be formatted but is not: the broker refuses to start.
    (data / "kraft-logs" / "meta.properties").write_text("version=1\ncluster.id=x\nnode.id=99\n")
    with pytest.raises(BrokerError, match=r"exited with code \d+ while starting; last lines"):
        LocalBroker(data, port=free_port()).up(quiet=True)


def test_missing_java_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # neither java nor mvn
    with pytest.raises(BrokerError, match="java not found on PATH: install a JDK 17"):
        LocalBroker(tmp_path / "k", port=free_port())._java()


def test_a_cluster_id_starting_with_a_dash_formats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import uuid

    # base64url of these bytes starts with "-": argparse4j must not read it as an option.
    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(bytes=b"\xfb" + b"\x00" * 15))
    broker = LocalBroker(tmp_path / "k", port=free_port())
    try:
        assert broker.up(quiet=True).pid > 0
    finally:
        broker.down(quiet=True)
