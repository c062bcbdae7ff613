"""Kafka client settings for secured clusters: `kafka.client_properties` and `kafka.secret_properties`
reach every client every process builds; secrets are `SecretStr` read from the environment or a
file, refused as literals, and never land in a run directory or an error message."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from stream_rl.config import KafkaConfig, load_config
from stream_rl.errors import ConfigError, KafkaError

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
SECRET = "s3cr3t-Hunter2-xyzzy"
SECURED = [
    "kafka.client_properties.security.protocol=SASL_SSL",
    "kafka.client_properties.sasl.mechanism=PLAIN",
    "kafka.client_properties.sasl.username=alice",
    "kafka.client_properties.socket.keepalive.enable=true",
    "kafka.secret_properties.sasl.password=${TEST_KAFKA_PASSWORD}",
]


@pytest.fixture
def password(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("TEST_KAFKA_PASSWORD", SECRET)
    return SECRET


def test_dotted_overrides_become_librdkafka_keys(password: str) -> None:
    cfg = load_config(None, SECURED)
    assert cfg.kafka.client_properties == {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "PLAIN",
        "sasl.username": "alice",
        "socket.keepalive.enable": "true",  # YAML's true, librdkafka's spelling
    }
    props = cfg.kafka.librdkafka_properties()
    assert isinstance(props["sasl.password"], SecretStr)
    assert props["sasl.password"].get_secret_value() == password
    assert password not in repr(props) and password not in str(cfg)


def test_a_secret_file_is_read_stripped(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text(SECRET + "\n")
    cfg = load_config(None, [f"kafka.secret_properties.ssl.key.password=file:{tmp_path / 'pw'}"])
    value = cfg.kafka.librdkafka_properties()["ssl.key.password"]
    assert isinstance(value, SecretStr) and value.get_secret_value() == SECRET


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "kafka.client_properties.sasl.password=x",
            r"sasl\.password holds a secret: put it in kafka\.secret_properties",
        ),
        (
            "kafka.secret_properties.sasl.password=hunter2",
            r"give a reference, \$\{ENV_VAR\} or file:PATH, never the secret",
        ),
        (
            "kafka.client_properties.bootstrap.servers=h:1",
            r"bootstrap\.servers is not settable \(set kafka\.bootstrap\)",
        ),
        ("kafka.client_properties.isolation.level=read_uncommitted", r"isolation\.level is not settable"),
    ],
)
def test_bad_properties_are_one_line_errors(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, [override])
    assert "\n" not in str(err.value) and "hunter2" not in str(err.value)


def test_a_missing_secret_names_its_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TEST_KAFKA_PASSWORD", raising=False)
    cfg = load_config(None, SECURED)  # loading needs no secret (status, report...): opening clients does
    with pytest.raises(
        ConfigError,
        match=r"kafka\.secret_properties\.sasl\.password: environment variable TEST_KAFKA_PASSWORD is not set",
    ):
        cfg.kafka.librdkafka_properties()
    cfg = load_config(None, [f"kafka.secret_properties.sasl.password=file:{tmp_path / 'nope'}"])
    with pytest.raises(ConfigError, match=r"sasl\.password: cannot read secret file .*nope"):
        cfg.kafka.librdkafka_properties()


class _Recorder:
    """Stands in for confluent_kafka's Producer, Consumer and AdminClient: records each conf."""

    confs: list[tuple[str, dict[str, Any]]] = []

    def __init__(self, conf: dict[str, Any]) -> None:
        _Recorder.confs.append((type(self).__name__, conf))

    def list_topics(self, timeout: float = 0, topic: str | None = None) -> Any:
        class Metadata:
            brokers = {0: "b"}

        return Metadata()

    def poll(self, timeout: float = 0) -> None:
        return None


class Producer(_Recorder):
    pass


class Consumer(_Recorder):
    pass


class AdminClient(_Recorder):
    pass


def test_every_client_constructor_gets_the_properties(password: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from stream_rl.kafka import confluent, probe

    _Recorder.confs = []
    monkeypatch.setattr(confluent.ck, "Producer", Producer)
    monkeypatch.setattr(confluent.ck, "Consumer", Consumer)
    monkeypatch.setattr(confluent, "AdminClient", AdminClient)
    monkeypatch.setattr(probe, "AdminClient", AdminClient)  # check_reachable's
    cfg = load_config(None, SECURED)
    kafka = confluent.KafkaTransport.for_config(cfg.kafka, "broker:9093")
    kafka.producer("p")
    kafka.producer("t", transactional_id="tx")
    kafka.consumer("g", "c")
    kafka.consumer("g", "c", instance_id="0")  # static member
    kafka.consumer(None, "follower")
    assert kafka.admin is not None
    kafka._offsets_consumer("g")
    kafka.check_reachable(timeout=1)
    kinds = [kind for kind, _ in _Recorder.confs]
    assert kinds == ["Producer"] * 2 + ["Consumer"] * 3 + ["AdminClient", "Consumer", "AdminClient"]
    for kind, conf in _Recorder.confs:
        assert conf["bootstrap.servers"] == "broker:9093"
        assert conf["security.protocol"] == "SASL_SSL" and conf["sasl.username"] == "alice", kind
        assert conf["sasl.password"] == password, kind  # unwrapped for librdkafka only
    assert password not in repr(vars(kafka))


@cache
def _sources() -> tuple[tuple[Path, str], ...]:
    return tuple((p, p.read_text()) for p in sorted((REPO / "stream_rl").rglob("*.py")))


@cache
def _nodes(path: Path) -> tuple[ast.AST, ...]:
    return tuple(ast.walk(ast.parse(path.read_text())))


def _receiver(call: ast.Call) -> str:
    """The name a method is called on (`Admission` in `Admission.for_config(...)`), else ''."""
    func = call.func
    return func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""


def _calls(name: str, methods: bool = True) -> list[tuple[Path, ast.Call]]:
    """Every call of `name` in stream_rl/ (`methods`: `x.name(...)` too)."""
    out = []
    for path, text in _sources():
        if f"{name}(" not in text:  # parse only the candidates (once): keeps the test fast
            continue
        for node in _nodes(path):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.id if isinstance(func, ast.Name) else ""
                if methods and isinstance(func, ast.Attribute):
                    called = func.attr
                if called == name:
                    out.append((path.relative_to(REPO), node))
    return out


def test_every_process_builds_its_transport_from_its_config() -> None:
    """Stages, trainer, launcher, status, lag, topics, replay, rescore, export, track: each builds
    its KafkaTransport with `KafkaTransport.for_run` (the properties, data dir, outage timeout and
    compression of its run config), never `for_config` or `KafkaTransport(...)` by hand (before,
    replay, export, track, rescore and lag skipped the data dir, the outage timeout and the
    compression), and every `check_reachable` outside the client passes properties."""
    bare = [f"{p}:{c.lineno}" for p, c in _calls("KafkaTransport")]
    assert bare == []
    by_hand = {
        f"{p}:{c.lineno}"
        for p, c in _calls("for_config")
        if str(p) != "stream_rl/kafka/confluent.py"
        and _receiver(c) != "Admission"  # the actor's, not Kafka's
    }
    assert by_hand == set(), by_hand
    users = {str(p) for p, _ in _calls("for_run")}
    for module in (
        "stages/entry.py",  # every stage's, the trainer's included
        "run/launch.py",
        "observe/status.py",
        "kafka/commands.py",
        "train/replay_trainer.py",
        "stages/preprocessor_replay.py",
        "run/monitor.py",
        "run/scaling.py",
        "tools/export.py",
        "tools/track.py",
        "tools/rescore.py",
    ):
        assert f"stream_rl/{module}" in users, module
    for path, call in _calls("check_reachable", methods=False):  # a transport's own carries them
        if path != Path("stream_rl/kafka/confluent.py"):
            assert any(k.arg == "properties" for k in call.keywords), f"{path}:{call.lineno}"
    # Raw librdkafka clients are built in the client modules only (plus the local broker's own
    # readiness probe, which talks to the broker it started).
    clients = {f"stream_rl/kafka/{m}.py" for m in ("confluent", "producer", "consumer", "probe", "broker")}
    for name in ("Producer", "Consumer", "AdminClient"):
        places = {str(p) for p, _ in _calls(name)}
        assert places <= clients, (name, places)


def test_a_refused_login_is_one_line_naming_the_problem(
    monkeypatch: pytest.MonkeyPatch, password: str
) -> None:
    import confluent_kafka as ck

    from stream_rl.kafka import probe

    class Refusing:
        def __init__(self, conf: dict[str, Any]) -> None:
            self.error_cb = conf["error_cb"]

        def list_topics(self, timeout: float = 0) -> Any:
            self.error_cb(
                ck.KafkaError(
                    ck.KafkaError._AUTHENTICATION, "SASL authentication error: Authentication failed"
                )
            )
            raise ck.KafkaException(ck.KafkaError(ck.KafkaError._TRANSPORT, "timed out"))

        def poll(self, timeout: float = 0) -> None:
            return None

    monkeypatch.setattr(probe, "AdminClient", Refusing)
    props = load_config(None, SECURED).kafka.librdkafka_properties()
    with pytest.raises(
        KafkaError, match=r"Kafka at b:1 refused our credentials: SASL authentication error"
    ) as err:
        probe.check_reachable("b:1", timeout=5, properties=props)
    assert "\n" not in str(err.value) and password not in str(err.value)


def test_the_run_directory_holds_no_secret(
    password: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stream_rl.kafka.stage import StopFlag
    from stream_rl.run.launch import Launcher

    monkeypatch.setenv("STREAM_RL_ADMIN_TOKEN", "admin-" + password)
    cfg = load_config(None, [f"runs_dir={tmp_path}", "kafka.bootstrap=broker:9093", *SECURED])
    launcher = Launcher(cfg, StopFlag())
    launcher.bootstrap = "broker:9093"
    launcher.plan()
    launcher.write_ports(1)
    files = [p for p in (tmp_path / cfg.run).rglob("*") if p.is_file()]
    assert len(files) > 10
    for path in files:
        assert password not in path.read_text(), path
    written = load_config(tmp_path / cfg.run / "actor-0" / "config.yaml")
    assert written.kafka.secret_properties == {"sasl.password": "${TEST_KAFKA_PASSWORD}"}
    # A child reads it back from its environment (inherited from the launcher).
    assert written.kafka.librdkafka_properties()["sasl.password"] == SecretStr(password)


def test_a_secured_local_broker_writes_one_listener_set(tmp_path: Path) -> None:
    from stream_rl.kafka.broker import LocalBroker
    from stream_rl.kafka.listener import SaslSslListener

    listener = SaslSslListener(
        port=9444,
        keystore=tmp_path / "b.p12",
        keystore_password="kp",
        ca_pem=tmp_path / "ca.pem",
        users={"alice": "alice-pass-77"},
    )
    broker = LocalBroker(tmp_path / "k", port=9443, listener=listener)
    broker.data_dir.mkdir()
    path = broker._write_config(9445)
    props = dict(
        line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#")
    )
    assert (
        props["listeners"]
        == "PLAINTEXT://127.0.0.1:9443,SASL_SSL://127.0.0.1:9444,CONTROLLER://127.0.0.1:9445"
    )
    assert props["listener.security.protocol.map"].endswith("SASL_SSL:SASL_SSL")
    assert 'user_alice="alice-pass-77"' in props["listener.name.sasl_ssl.plain.sasl.jaas.config"]
    assert sum(line.startswith("listeners=") for line in path.read_text().splitlines()) == 1
    assert path.stat().st_mode & 0o077 == 0  # passwords inside: the owner's only
    assert "alice-pass-77" not in repr(listener) and "kp" not in repr(listener)
    with pytest.raises(ValueError, match="may not hold quotes"):
        SaslSslListener(9444, tmp_path, "kp", tmp_path, {"bob": 'p"w'}).server_properties("127.0.0.1")


def test_a_runs_transport_takes_its_data_dir_outage_timeout_and_compression(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    monkeypatch.delenv("STREAM_RL_KAFKA_BOOTSTRAP", raising=False)

    from stream_rl.kafka.confluent import KafkaTransport

    (tmp_path / "cluster.json").write_text(json.dumps({"ports": [19092, 19093]}))
    kafka = KafkaConfig(data_dir=str(tmp_path), outage_timeout_s=7.5, compression="zstd")
    transport = KafkaTransport.for_run(kafka)
    assert transport.bootstrap == "127.0.0.1:19092,127.0.0.1:19093"
    assert (transport.outage_s, transport.compression) == (7.5, "zstd")
    assert KafkaTransport.for_run(kafka, "elsewhere:9092").bootstrap == "elsewhere:9092"
