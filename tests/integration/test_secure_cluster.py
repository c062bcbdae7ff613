"""Tries to get into the cluster `stream-rl kafka up --secure` makes (one broker for the module):
each stage's principal may do what the topology gives it and nothing else, runs are apart, and
no credentials, a wrong password, a foreign or expired client certificate are refused by the
broker; every refusal reaches the user as one line naming the principal and the right it lacks.
(The item-1 ACL tests on a SASL/PLAIN broker: tests/integration/test_acls_on_a_broker.py.)"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from stream_rl.cli import main as cli_main
from stream_rl.common.ports import free_port, port_is_free
from stream_rl.config import KafkaConfig, load_config
from stream_rl.errors import KafkaError
from stream_rl.kafka.broker import LocalBroker
from stream_rl.kafka.confluent import KafkaTransport
from stream_rl.kafka.probe import check_reachable
from stream_rl.kafka.secure import ENROLLED, Pki, secure_listeners
from stream_rl.kafka.topics import (
    PROBLEMS,
    RAW_ROLLOUTS,
    SCORED,
    TRAINING_BATCHES,
    WEIGHT_VERSIONS,
    TopicNames,
)

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

RUN = f"sec{uuid.uuid4().hex[:6]}"
OTHER_RUN = f"oth{uuid.uuid4().hex[:6]}"
NO_ACL = r"that principal has no such ACL"


@dataclass(frozen=True)
class Secured:
    data_dir: Path
    kafka: KafkaConfig
    """The run's `kafka:` section as `kafka up --secure` wrote it (SCRAM, every kind's credentials)."""
    mtls: KafkaConfig
    """The same over the mutual-TLS listener."""
    expired: tuple[Path, Path]
    """A certificate (and key) of our CA for the actor's CN that expired a second after it was made."""

    def transport(self, role: str, kafka: KafkaConfig | None = None) -> KafkaTransport:
        cfg = (kafka or self.kafka).for_role(role)
        return KafkaTransport.for_config(cfg, cfg.bootstrap or "", outage_s=10)


def _kafka_section(path: Path) -> KafkaConfig:
    return load_config(path, [f"run={RUN}"]).kafka


def _two_free_ports() -> int:
    """A port whose successor is free too (`up --secure` puts the mutual-TLS listener there)."""
    for _ in range(50):
        port = free_port()
        if port_is_free(port + 1):
            return port
    raise AssertionError("no two adjacent free ports")


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    data_dir = tmp_path_factory.mktemp("secure") / "kafka"
    args = ["kafka", "up", "--secure", "--data-dir", str(data_dir), "--port", str(_two_free_ports())]
    assert cli_main([*args, "--run", RUN, "--quiet"]) == 0
    try:
        listeners = secure_listeners(data_dir)
        assert listeners is not None
        expired = listeners.pki.issue("expired-actor", f"{RUN}-actor", days=0)
        run_dir = data_dir / "secure" / "runs" / RUN
        cfg = Secured(
            data_dir,
            _kafka_section(run_dir / "kafka.yaml"),
            _kafka_section(run_dir / "kafka-mtls.yaml"),
            expired,
        )
        launcher = cfg.transport("launcher")  # the launcher's rights make the run's topics
        from stream_rl.kafka.topics import apply_topics

        apply_topics(launcher, TopicNames(RUN), None)
        yield cfg
    finally:
        LocalBroker(data_dir).down(quiet=True)


def test_up_secure_leaves_no_open_door_and_no_secret_in_the_configs(secured: Secured) -> None:
    props = dict(
        line.split("=", 1)
        for line in (secured.data_dir / "server.properties").read_text().splitlines()
        if "=" in line
    )
    assert "PLAINTEXT" not in props["listeners"]  # every listener authenticates
    assert props["super.users"] == "User:broker;User:operator"
    assert props["allow.everyone.if.no.acl.found"] == "false"
    assert props["authorizer.class.name"] == "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
    run_dir = secured.data_dir / "secure" / "runs" / RUN
    texts = (run_dir / "kafka.yaml").read_text() + (run_dir / "kafka-mtls.yaml").read_text()
    secrets = [*run_dir.glob("*.password"), *(secured.data_dir / "secure").rglob("*.key")]
    assert len(list(run_dir.glob("*.password"))) == len(ENROLLED)
    for path in secrets:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        assert path.read_text().strip() not in texts  # by reference only
    assert secured.kafka.principals.actor == f"User:{RUN}-actor"
    assert secured.kafka.for_role("actor").client_properties["sasl.username"] == f"{RUN}-actor"


def test_the_actor_may_write_rollouts_but_not_training_batches(secured: Secured) -> None:
    names = TopicNames(RUN)
    for kafka in (secured.kafka, secured.mtls):  # SCRAM, then its certificate
        producer = secured.transport("actor", kafka).producer("actor-test")
        producer.produce(names[RAW_ROLLOUTS], b"x", key="k")
        producer.flush(timeout=20)  # its own topic: allowed
        producer.produce(names[TRAINING_BATCHES], b"steer the gradients", key="k")
        with pytest.raises(KafkaError) as refused:
            producer.flush(timeout=20)
        assert (
            f"Kafka refused User:{RUN}-actor WRITE on topic {names[TRAINING_BATCHES]} "
            "(TOPIC_AUTHORIZATION_FAILED)" in str(refused.value)
        )
        assert "\n" not in str(refused.value)


def test_a_verifier_may_not_take_a_transactional_id_or_read_weight_versions(secured: Secured) -> None:
    names = TopicNames(RUN)
    verifier = secured.transport("verifier")
    for txn in (f"stream-rl.{RUN}.preprocessor.0", f"stream-rl.{RUN}.trainer.0"):
        producer = verifier.producer("verifier-test", transactional_id=txn)
        with pytest.raises(KafkaError, match=NO_ACL) as refused:
            producer.init_transactions(timeout=20)
        assert str(refused.value).startswith(
            f"Kafka refused User:{RUN}-verifier WRITE on transactional id {txn} "
            "(TRANSACTIONAL_ID_AUTHORIZATION_FAILED)"
        )
    consumer = verifier.consumer(names.group("verifier"), "verifier-test")
    consumer.subscribe([names[WEIGHT_VERSIONS]])
    with pytest.raises(KafkaError, match=NO_ACL) as refused:
        for _ in range(40):
            consumer.poll_batch(10, 0.5)
    assert str(refused.value).startswith(
        f"Kafka refused User:{RUN}-verifier READ on topic {names[WEIGHT_VERSIONS]} (TOPIC_AUTHORIZATION_FAILED)"
    )


def test_a_second_runs_principal_cannot_read_the_first_runs_topics(secured: Secured) -> None:
    args = ["kafka", "up", "--secure", "--data-dir", str(secured.data_dir), "--run", OTHER_RUN, "--quiet"]
    assert cli_main(args) == 0  # the running broker: only enrolls the second run
    other = load_config(secured.data_dir / "secure" / "runs" / OTHER_RUN / "kafka.yaml").kafka
    mine = TopicNames(RUN)
    for role, topic in (("actor", PROBLEMS), ("trainer", TRAINING_BATCHES)):
        consumer = secured.transport(role, other).consumer(TopicNames(OTHER_RUN).group(role), f"{role}-other")
        consumer.subscribe([mine[topic]])
        with pytest.raises(KafkaError, match=NO_ACL) as refused:
            for _ in range(40):
                consumer.poll_batch(10, 0.5)
        assert str(refused.value).startswith(
            f"Kafka refused User:{OTHER_RUN}-{role} READ on topic {mine[topic]} (TOPIC_AUTHORIZATION_FAILED)"
        )


def _refused(kafka: KafkaConfig, **props: str) -> str:
    with pytest.raises(KafkaError) as refused:
        check_reachable(kafka.bootstrap or "", 8, {**kafka.librdkafka_properties(), **props})
    assert "\n" not in str(refused.value)
    return str(refused.value)


def test_no_credentials_a_wrong_password_and_strangers_certificates_are_refused(
    secured: Secured, tmp_path: Path
) -> None:
    actor, mtls = secured.kafka.for_role("actor"), secured.mtls.for_role("actor")
    bare = {"security.protocol": "SSL", "ssl.ca.location": actor.client_properties["ssl.ca.location"]}
    no_sasl = KafkaConfig(bootstrap=actor.bootstrap, client_properties=bare)
    assert "wants SASL credentials and we gave none" in _refused(no_sasl)
    no_cert = KafkaConfig(bootstrap=mtls.bootstrap, client_properties=bare)
    assert re.match(
        r"Kafka at \S+ refused our TLS client certificate: .*alert.*\(as User:ANONYMOUS, no client certificate;",
        _refused(no_cert),
    )
    wrong = _refused(actor, **{"sasl.password": "not-the-password"})
    assert re.match(r"Kafka at \S+ refused our credentials: .*invalid credentials", wrong)
    assert f"(as User:{RUN}-actor;" in wrong
    foreign = Pki(tmp_path / "foreign-ca")
    foreign.make_ca()
    crt, key = foreign.issue("actor", f"{RUN}-actor")  # the right name, signed by a stranger
    for cert, key_ in ((crt, key), secured.expired):
        message = _refused(mtls, **{"ssl.certificate.location": str(cert), "ssl.key.location": str(key_)})
        assert re.match(
            rf"Kafka at \S+ refused our TLS client certificate: .*certificate unknown.*\(as User:{RUN}-actor, "
            "a client certificate;",
            message,
        )


def test_a_stage_command_with_a_wrong_password_exits_with_one_line(
    secured: Secured, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = secured.data_dir / "secure" / "runs" / RUN
    data = yaml.safe_load((run_dir / "kafka.yaml").read_text())
    wrong = tmp_path / "wrong.password"
    wrong.write_text("not-the-password")
    data["kafka"]["credentials"]["loader"]["secret_properties"]["sasl.password"] = f"file:{wrong}"
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"run": RUN, **data}))
    assert cli_main(["loader", "--config", str(path), "--max-records", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not-the-password" not in err
    assert err.startswith("error: Kafka at ") and f"(as User:{RUN}-loader;" in err


def _stage_environments(processes: Path, proc: subprocess.Popen[str], passwords: dict[str, str]) -> set[str]:
    """Reads each running stage's /proc/<pid>/environ (pids from the launcher's processes.json)
    until the long-running kinds were all seen or the run ends; asserts none holds another kind's
    variable or password. Returns the kinds checked."""
    checked: set[str] = set()
    wanted = {"actor", "verifier", "preprocessor", "trainer"}
    while proc.poll() is None and not wanted <= checked:
        try:
            pids = json.loads(processes.read_text()).get("pids", {})
        except (OSError, ValueError):
            pids = {}
        for name, pid in pids.items():
            kind = name.split("-")[0]
            if kind not in passwords or kind in checked:
                continue
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
            except OSError:
                continue  # it ended meanwhile
            for other, pw in passwords.items():
                if other != kind:
                    assert f"SECTEST_PW_{other.upper()}=" not in environ, (name, other)
                    assert pw not in environ, (name, other)
            checked.add(kind)
        time.sleep(0.2)  # polling a file another process rewrites: nothing to wait on
    return checked


@pytest.mark.e2e
def test_a_whole_run_finishes_with_each_stage_on_its_own_principal(secured: Secured, tmp_path: Path) -> None:
    """`kafka up --secure --config` on the running broker enrolls a third run and writes its run
    config; `stream-rl run` is given it without the operator's credentials (no process of the run
    may fall back to the super user), each password as an environment variable of the launcher.
    While it runs, no stage's process environment holds another kind's variable or password; it
    finishes; each stage's config names only its own user; the counts are read from the topics."""
    from stream_rl.inference.model_maker import make_model
    from stream_rl.train.lineage import read_weight_versions

    run = f"whole{uuid.uuid4().hex[:6]}"
    base = {
        "run": run,
        "runs_dir": str(tmp_path / "runs"),
        "model": {"path": str(make_model(tmp_path / "tiny", "tiny", seed=0))},
        "kafka": {"partitions": 2},
        "task": {"name": "arithmetic", "params": {"num_problems": 100}},
        "actor": {"group_size": 4, "max_lag": 1, "sampling": {"max_tokens": 4}},
        "inference": {"num_servers": 1, "base_port": free_port(), "max_batch": 32},
        "trainer": {"samples_per_step": 8, "max_steps": 3, "bucket_mb": 1, "checkpoint_every": 3},
        "launcher": {"max_wall_s": 120},
    }
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    up = ["kafka", "up", "--secure", "--data-dir", str(secured.data_dir), "--quiet"]
    assert cli_main([*up, "--config", str(tmp_path / "base.yaml")]) == 0
    run_yaml = secured.data_dir / "secure" / "runs" / run / "run.yaml"
    config = yaml.safe_load(run_yaml.read_text())
    del config["kafka"]["credentials"]["operator"]
    passwords = {}
    for role, creds in config["kafka"]["credentials"].items():
        passwords[role] = (run_yaml.parent / f"{role}.password").read_text()
        creds["secret_properties"]["sasl.password"] = f"${{SECTEST_PW_{role.upper()}}}"
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, **{f"SECTEST_PW_{r.upper()}": pw for r, pw in passwords.items()}}
    with subprocess.Popen(
        [sys.executable, "-m", "stream_rl.cli", "run", str(tmp_path / "run.yaml")],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    ) as proc:
        checked = _stage_environments(tmp_path / "runs" / run / "processes.json", proc, passwords)
        out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-4000:]
    assert {"actor", "verifier", "preprocessor", "trainer"} <= checked

    for name in ("loader", "actor-0", "verifier-0", "preprocessor-0", "trainer"):
        seen = load_config(tmp_path / "runs" / run / name / "config.yaml").kafka
        role = name.split("-")[0]
        assert seen.credentials == {}
        assert seen.client_properties["sasl.username"] == f"{run}-{role}"
        assert seen.secret_properties == {"sasl.password": f"${{SECTEST_PW_{role.upper()}}}"}
    operator = KafkaTransport.for_run(load_config(run_yaml).kafka)  # the operator reads the counts
    names = TopicNames(run)
    lineage = read_weight_versions(operator, names)
    assert lineage[-1].version == 3 and lineage[-1].samples_trained >= 3 * 8
    counts = {
        t: sum(high - low for low, high in operator.watermarks(names[t]).values())
        for t in (PROBLEMS, RAW_ROLLOUTS, SCORED, TRAINING_BATCHES)
    }
    assert counts[PROBLEMS] > 0 and counts[TRAINING_BATCHES] > 0
    assert counts[RAW_ROLLOUTS] >= 3 * 8 and counts[SCORED] >= 3 * 8


def test_a_stage_run_as_another_kind_stops_with_one_line(
    secured: Secured, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The verifier started with the actor's principal and credentials (a consistent config, so it
    passes validation): the broker refuses it its group, and the stage command exits 2 with one
    line naming the principal and the right, no traceback."""
    run_dir = secured.data_dir / "secure" / "runs" / RUN
    data = yaml.safe_load((run_dir / "kafka.yaml").read_text())
    data["kafka"]["principals"]["verifier"] = data["kafka"]["principals"]["actor"]
    data["kafka"]["credentials"]["verifier"] = data["kafka"]["credentials"]["actor"]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"run": RUN, **data}))
    assert cli_main(["verifier", "--config", str(path), "--max-records", "1", "--idle-timeout", "20"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(
        f"error: Kafka refused User:{RUN}-actor READ on group stream-rl.{RUN}.verifier (GROUP_AUTHORIZATION_FAILED)"
    )
