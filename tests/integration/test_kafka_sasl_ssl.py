"""A real broker with a SASL/PLAIN-over-TLS listener (its keystore made here with the JDK's
`keytool`): a run config with credentials (`kafka.client_properties` + a `${ENV}` secret) creates
its topics through the CLI and moves records, transactions included; a client with wrong
credentials, none, or no CA gets one line naming the problem; no secret reaches the output."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from keystores import make_keystore

from stream_rl.cli import main as cli_main
from stream_rl.common.ports import free_port
from stream_rl.config import load_config
from stream_rl.errors import KafkaError
from stream_rl.kafka.broker import LocalBroker
from stream_rl.kafka.confluent import KafkaTransport, check_reachable
from stream_rl.kafka.listener import SaslSslListener
from stream_rl.kafka.topics import PROBLEMS, TopicNames

pytestmark = pytest.mark.integration

PASSWORD = "alice-" + uuid.uuid4().hex
STORE_PASSWORD = uuid.uuid4().hex


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SaslSslListener]:
    d = tmp_path_factory.mktemp("sasl")
    store, pem = make_keystore(d, STORE_PASSWORD)
    listener = SaslSslListener(
        port=free_port(),
        keystore=store,
        keystore_password=STORE_PASSWORD,
        ca_pem=pem,
        users={"alice": PASSWORD},
    )
    broker = LocalBroker(d / "kafka", port=free_port(), listener=listener)
    broker.up(quiet=True)
    try:
        yield listener
    finally:
        broker.down(quiet=True)


def _config_file(tmp_path: Path, listener: SaslSslListener, run: str) -> Path:
    lines = [f"run: {run}", "kafka:", f"  bootstrap: 127.0.0.1:{listener.port}", "  client_properties:"]
    lines += [f"    {k}: {v}" for k, v in listener.client_properties("alice").items()]
    lines += ["  secret_properties:", "    sasl.password: ${TEST_SASL_PASSWORD}"]
    path = tmp_path / "secured.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_credentials_work_through_the_cli_and_the_clients(
    secured: SaslSslListener,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("TEST_SASL_PASSWORD", PASSWORD)
    run = f"sasl{uuid.uuid4().hex[:8]}"
    path = _config_file(tmp_path, secured, run)
    assert cli_main(["topics", "apply", "--config", str(path)]) == 0
    out = capsys.readouterr()
    assert f"run {run} on 127.0.0.1:{secured.port}:" in out.out and PASSWORD not in out.out + out.err
    cfg = load_config(path)
    kafka = KafkaTransport.for_config(cfg.kafka, f"127.0.0.1:{secured.port}")
    topic = TopicNames(run=run)[PROBLEMS]
    producer = kafka.producer("tx", transactional_id=f"tx-{run}")
    producer.init_transactions()
    producer.begin_transaction()
    producer.produce(topic, b"one", key="k")
    producer.commit_transaction()
    consumer = kafka.consumer(f"g-{run}", "reader")
    consumer.subscribe([topic])
    got = []
    for _ in range(40):
        got += consumer.poll_batch(10, 0.5)
        if got:
            break
    consumer.close()
    assert [m.value for m in got] == [b"one"]
    assert cli_main(["lag", "--config", str(path), "--no-age"]) == 0


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("wrong password", r"^Kafka at \S+ refused our credentials: .*SASL authentication error.*Invalid username or password"),
        ("no security settings", r"^Kafka at \S+ accepts connections but closes them before answering: most likely a security\.protocol mismatch"),
        ("no CA", r"^TLS with Kafka at \S+ failed: .*certificate verify failed"),
        ("no username", r"^Kafka client configuration refused: .*sasl\.username and sasl\.password must be set"),
    ],
)  # fmt: skip
def test_bad_credentials_are_one_line_naming_the_problem(
    secured: SaslSslListener, case: str, message: str
) -> None:
    good = {**secured.client_properties("alice"), "sasl.password": PASSWORD}
    props = {
        "wrong password": {**good, "sasl.password": "not-" + PASSWORD},
        "no security settings": {},
        "no CA": {k: v for k, v in good.items() if k != "ssl.ca.location"},
        "no username": {k: v for k, v in good.items() if k not in ("sasl.username", "sasl.password")},
    }[case]
    with pytest.raises(KafkaError, match=message) as err:
        check_reachable(f"127.0.0.1:{secured.port}", timeout=3, properties=props)
    assert "\n" not in str(err.value) and PASSWORD not in str(err.value)
