"""`stream-rl acls apply` against a real KRaft broker that authorizes with ACLs (StandardAuthorizer,
SASL/PLAIN over TLS, `admin` a super user): the bindings read back equal the plan, a second apply
has nothing to do, an extra binding on the run is reported and deleted only when asked; the
preprocessor, as its principal with only its planned rights, really runs (transactions, group,
followers, DLQ) and is refused what is not planned; a caller without rights and a broker without
an authorizer each get one line."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakes.records import make_scored, make_weight_version
from keystores import make_keystore

from stream_rl.cli import main as cli_main
from stream_rl.common.ports import free_port
from stream_rl.config import RunConfig, load_config
from stream_rl.errors import KafkaError
from stream_rl.kafka.acl_admin import KafkaAcls
from stream_rl.kafka.acls import ROLES, Acl, in_scope, plan_acls
from stream_rl.kafka.broker import LocalBroker
from stream_rl.kafka.confluent import KafkaTransport
from stream_rl.kafka.listener import SaslSslListener
from stream_rl.kafka.reader import read_to_end
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.topics import RAW_ROLLOUTS, SCORED, TRAINING_BATCHES, WEIGHT_VERSIONS, TopicNames
from stream_rl.stages import preprocessor

pytestmark = pytest.mark.integration

PASSWORDS = {"admin": "admin-" + uuid.uuid4().hex, "preprocessor": "pre-" + uuid.uuid4().hex}
STORE_PASSWORD = uuid.uuid4().hex


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SaslSslListener]:
    d = tmp_path_factory.mktemp("acls")
    store, pem = make_keystore(d, STORE_PASSWORD)
    listener = SaslSslListener(
        port=free_port(),
        keystore=store,
        keystore_password=STORE_PASSWORD,
        ca_pem=pem,
        users=PASSWORDS,
        acl_super_users=("admin",),
    )
    broker = LocalBroker(d / "kafka", port=free_port(), listener=listener)
    broker.up(quiet=True)
    try:
        yield listener
    finally:
        broker.down(quiet=True)


def _config(tmp_path: Path, bootstrap: str, run: str, client: dict[str, str] | None, user: str) -> Path:
    lines = [f"run: {run}", "actor: {group_size: 2}", "kafka:", f"  bootstrap: {bootstrap}", "  principals:"]
    lines += [f"    {role}: User:{role}" for role in ROLES]
    if client:
        lines += ["  client_properties:", *(f"    {k}: {v}" for k, v in client.items())]
        lines += ["  secret_properties:", f"    sasl.password: ${{TEST_ACL_PASSWORD_{user.upper()}}}"]
    path = tmp_path / f"{user}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _as(
    listener: SaslSslListener, tmp_path: Path, run: str, user: str, monkeypatch: pytest.MonkeyPatch
) -> Path:
    monkeypatch.setenv(f"TEST_ACL_PASSWORD_{user.upper()}", PASSWORDS.get(user, "unknown"))
    return _config(tmp_path, f"127.0.0.1:{listener.port}", run, listener.client_properties(user), user)


def _run_acls(cfg: RunConfig, admin: KafkaAcls) -> set[Acl]:
    names = TopicNames(cfg.run, cfg.kafka.prefix)
    principals = {p for p in cfg.kafka.principals.model_dump().values() if p}
    return {a for a in admin.describe() if in_scope(a, names, principals)}


def _run_acls_become(cfg: RunConfig, admin: KafkaAcls, want: set[Acl], timeout_s: float = 30.0) -> set[Acl]:
    """The run's bindings once they equal `want` (or at the deadline): a broker's authorizer takes
    a created or deleted binding from the metadata log after the call returned, so DescribeAcls
    right after can still show the one before (seen in a clean-clone run: the deleted extra)."""
    deadline = time.monotonic() + timeout_s
    while (got := _run_acls(cfg, admin)) != want and time.monotonic() < deadline:
        time.sleep(0.2)
    return got


def test_apply_makes_the_cluster_hold_the_plan_and_then_has_nothing_to_do(
    secured: SaslSslListener,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = f"acl{uuid.uuid4().hex[:8]}"
    path = _as(secured, tmp_path, run, "admin", monkeypatch)
    cfg = load_config(path)
    planned = {row.acl for row in plan_acls(TopicNames(run), cfg.kafka.principals.model_dump())}
    assert cli_main(["acls", "apply", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{len(planned)} ACL bindings created, 0 already there" in out
    transport = KafkaTransport.for_config(cfg.kafka, cfg.kafka.bootstrap or "")
    admin = KafkaAcls(transport.admin, transport.bootstrap)
    assert _run_acls_become(cfg, admin, planned) == planned  # read back with describe_acls

    assert cli_main(["acls", "apply", "--config", str(path)]) == 0
    assert f"0 ACL bindings created, {len(planned)} already there; nothing to do" in capsys.readouterr().out

    stranger = Acl("User:mallory", "TOPIC", f"stream-rl.{run}.scored", "LITERAL", "READ")
    admin.create([stranger])
    assert _run_acls_become(cfg, admin, planned | {stranger}) == planned | {stranger}
    assert cli_main(["acls", "apply", "--config", str(path)]) == 1
    out = capsys.readouterr().out
    assert "extra, not in the plan (--delete-extra deletes it): User:mallory READ TOPIC" in out
    assert stranger in admin.describe()
    assert cli_main(["acls", "apply", "--config", str(path), "--delete-extra"]) == 0
    assert "1 extra deleted" in capsys.readouterr().out
    assert _run_acls_become(cfg, admin, planned) == planned


def test_the_preprocessor_runs_with_its_rights_and_is_refused_the_rest(
    secured: SaslSslListener,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = f"acl{uuid.uuid4().hex[:8]}"
    admin_path = _as(secured, tmp_path, run, "admin", monkeypatch)
    assert cli_main(["topics", "apply", "--config", str(admin_path)]) == 0
    assert cli_main(["acls", "apply", "--config", str(admin_path)]) == 0
    capsys.readouterr()
    names, serde = TopicNames(run), default_serde()
    admin_cfg = load_config(admin_path)
    admin = KafkaTransport.for_config(admin_cfg.kafka, admin_cfg.kafka.bootstrap or "")
    setup = admin.producer("setup")
    setup.produce(names[WEIGHT_VERSIONS], serde.encode(make_weight_version(0, run_id=run)), key=run)
    for k in range(2):
        scored = make_scored(0, k, 2, reward=float(k))
        setup.produce(names[SCORED], serde.encode(scored), key=scored.rollout.group_id)
    setup.produce(names[SCORED], b"not scored", key="x")
    setup.flush()

    cfg = load_config(_as(secured, tmp_path, run, "preprocessor", monkeypatch))
    kafka = KafkaTransport.for_config(cfg.kafka, cfg.kafka.bootstrap or "")
    stats = preprocessor.run(cfg, transport=kafka, max_records=3, idle_timeout_s=20)
    assert stats.records_in == 3
    assert len(list(read_to_end(admin, names[TRAINING_BATCHES]))) == 1
    assert len(list(read_to_end(admin, names.dlq(SCORED)))) == 1
    ends = {p: high for p, (_low, high) in admin.watermarks(names[SCORED]).items() if high}
    committed = admin.group_offsets(names.group("preprocessor"), names[SCORED])
    assert {p: committed[p] for p in ends} == ends  # committed in its transactions

    producer = kafka.producer("not-mine")
    producer.produce(names[RAW_ROLLOUTS], b"x", key="k")
    with pytest.raises(KafkaError, match="(?i)authoriz"):
        producer.flush(timeout=15)
    other = kafka.producer("not-mine-either", transactional_id=f"stream-rl.{run}.trainer.0")
    with pytest.raises(KafkaError, match="(?i)authoriz"):
        other.init_transactions(timeout=15)


def test_a_caller_without_rights_gets_one_line(
    secured: SaslSslListener,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = _as(secured, tmp_path, f"acl{uuid.uuid4().hex[:8]}", "preprocessor", monkeypatch)
    assert cli_main(["acls", "apply", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"error: Kafka at 127.0.0.1:{secured.port} refused to create ACLs (CLUSTER_AUTHORIZATION_FAILED)"
    )
    assert err.count("\n") == 1 and PASSWORDS["preprocessor"] not in err


def test_a_broker_without_an_authorizer_is_one_line(
    kafka_bootstrap: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _config(tmp_path, kafka_bootstrap, f"acl{uuid.uuid4().hex[:8]}", None, "anyone")
    assert cli_main(["acls", "apply", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: Kafka at {kafka_bootstrap} has no authorizer (SECURITY_DISABLED)")
    assert err.count("\n") == 1
