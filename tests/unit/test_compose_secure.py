"""The secured Compose variant, checked without Docker (tests/docker/test_compose.py brings it up for
real): deploy/compose/secure.yml grants each service exactly the secrets `compose_secrets.GRANTS`
names, its broker settings are those of `kafka up --secure` (no PLAINTEXT listener, the
StandardAuthorizer, the broker and the operator the only super users), every stream-rl command in it
reads /etc/stream-rl/run.yaml (the operator's commands parse) and each config loads, each stage's config written by `stream-rl kafka compose-secrets` names
that stage's own principal and credentials only (secrets by reference), and the Kafka entry point
formats the storage with the operator's SCRAM user from its secret file."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from stream_rl.cli import main as cli_main
from stream_rl.config import load_config
from stream_rl.kafka.compose_secrets import GRANTS, STAGE_ROLES
from stream_rl.kafka.secure import AUTHORIZER, OPERATOR, PRINCIPAL_RULE

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
OVERLAY: dict[str, Any] = yaml.safe_load((REPO / "deploy" / "compose" / "secure.yml").read_text())
SERVICES: dict[str, Any] = OVERLAY["services"]
RUN = "demo-docker"
LIGHT = {"kafka", "acls", "topics", "lag"}
"""The commands whose parsers import no stage (cheap to build here)."""


@pytest.fixture(scope="module")
def secrets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("compose-secrets")
    assert cli_main(["kafka", "compose-secrets", "--out", str(out), "--port", "19999"]) == 0
    return out


def test_each_service_is_granted_exactly_its_own_secrets() -> None:
    files = {name: spec["file"].rsplit("/", 1)[1] for name, spec in OVERLAY["secrets"].items()}
    granted = {service: {s["target"] for s in spec.get("secrets", [])} for service, spec in SERVICES.items()}
    assert granted == {service: set(names) for service, names in GRANTS.items()}
    for service, spec in SERVICES.items():
        for s in spec.get("secrets", []):
            assert files[s["source"]] == s["target"], (service, s)  # mounted under its file's name
    for role in STAGE_ROLES:
        assert SERVICES[role]["configs"] == [
            {"source": f"{role}-config", "target": "/etc/stream-rl/run.yaml"}
        ]
        assert OVERLAY["configs"][f"{role}-config"]["file"].endswith(f"/{role}.yaml")


def test_the_broker_is_secured_as_kafka_up_secure() -> None:
    env = SERVICES["kafka"]["environment"]
    assert "PLAINTEXT" not in env["KAFKA_LISTENERS"] + env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"]
    clients = [
        lst for lst in env["KAFKA_LISTENERS"].split(",") if not lst.startswith(("CONTROLLER", "INTERNAL"))
    ]
    assert clients == ["SASL_SSL://:19092", "SASL_SSL_HOST://:9092"]
    for lst in env["KAFKA_LISTENERS"].split(","):  # the mutual-TLS ones on the container's loopback
        if lst.startswith(("CONTROLLER", "INTERNAL")):
            assert "://127.0.0.1:" in lst, lst
    assert env["KAFKA_AUTHORIZER_CLASS_NAME"] == AUTHORIZER
    assert env["KAFKA_ALLOW_EVERYONE_IF_NO_ACL_FOUND"] == "false"
    assert env["KAFKA_SUPER_USERS"] == f"User:broker;User:{OPERATOR}"
    assert env["KAFKA_SSL_PRINCIPAL_MAPPING_RULES"].replace("$$", "$") == PRINCIPAL_RULE
    assert env["KAFKA_SSL_CLIENT_AUTH"] == "required"


def test_every_command_parses_and_its_config_loads(secrets: Path) -> None:
    from stream_rl.cli import command_parser

    configs = {spec["configs"][0]["source"]: spec for spec in SERVICES.values() if spec.get("configs")}
    assert set(configs) == {f"{r}-config" for r in (*STAGE_ROLES, OPERATOR)}
    for service, spec in SERVICES.items():
        if "command" not in spec:
            continue
        command = spec["command"]
        line = command[0] if len(command) == 1 else shlex.join(["stream-rl", *command])
        for part in line.split("&&"):
            words = shlex.split(part.strip().removeprefix("exec "))
            if words[:1] != ["stream-rl"] or words[1] == "make-model":
                continue
            assert words[words.index("--config") + 1] == "/etc/stream-rl/run.yaml", (service, words)
            if words[1] in LIGHT:  # the stages' parsers import torch: test_deploy.py parses those
                parser, _ = command_parser(words[1])
                assert parser.parse_args(words[2:]).config == "/etc/stream-rl/run.yaml"
            source = spec["configs"][0]["source"].removesuffix("-config")
            cfg = load_config(secrets / f"{source}.yaml")
            assert cfg.run == RUN and cfg.kafka.bootstrap == "kafka:19092"


def test_each_stage_config_names_its_own_credentials_only(secrets: Path) -> None:
    passwords = {role: (secrets / f"{role}.password").read_text() for role in (*STAGE_ROLES, OPERATOR)}
    for path in [*secrets.glob("*.password"), secrets / "broker.pem", secrets / "pki" / "ca.key"]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    for role in STAGE_ROLES:
        text = (secrets / f"{role}.yaml").read_text()
        kafka = load_config(secrets / f"{role}.yaml").kafka
        assert set(kafka.credentials) == {role}
        own = kafka.for_role(role)
        assert own.client_properties["sasl.username"] == f"{RUN}-{role}"
        assert own.secret_properties == {"sasl.password": f"file:/run/secrets/{role}.password"}
        assert getattr(kafka.principals, role) == f"User:{RUN}-{role}"
        assert own.client_properties["ssl.ca.location"] == "/run/secrets/ca.pem"
        others = [r for r in (*STAGE_ROLES, OPERATOR) if r != role]
        assert not [r for r in others if f"{r}.password" in text or f"{RUN}-{r}" in text], role
        assert not [v for v in passwords.values() if v in text]
    operator = load_config(secrets / "operator.yaml").kafka
    assert set(operator.credentials) == {OPERATOR}
    assert all(getattr(operator.principals, r) == f"User:{RUN}-{r}" for r in STAGE_ROLES)
    host = load_config(secrets / "host.yaml").kafka
    assert host.bootstrap == "localhost:19999"
    assert host.for_role(OPERATOR).secret_properties["sasl.password"] == f"file:{secrets}/operator.password"


def test_compose_secrets_keeps_what_it_made(secrets: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = {p: p.read_bytes() for p in secrets.rglob("*") if p.is_file()}
    assert cli_main(["kafka", "compose-secrets", "--out", str(secrets), "--port", "19999"]) == 0
    assert "0 files made" in capsys.readouterr().out
    assert {p: p.read_bytes() for p in secrets.rglob("*") if p.is_file()} == before


def test_kafka_entry_point_formats_with_the_operators_scram_user(tmp_path: Path, secrets: Path) -> None:
    (tmp_path / "config").mkdir()
    (tmp_path / "bin").mkdir()
    java = tmp_path / "bin" / "java"
    java.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/java.log\n')
    java.chmod(0o755)
    env = {k: str(v) for k, v in SERVICES["kafka"]["environment"].items()}
    env |= {
        "CLUSTER_ID": "4L6g3nShT-eMCtK--X86sw",
        "KAFKA_LOG_DIRS": str(tmp_path / "data"),
        "STREAM_RL_KAFKA_OPERATOR_PASSWORD_FILE": str(secrets / "operator.password"),
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "STREAM_RL_KAFKA_HOME": str(tmp_path),
    }
    subprocess.run([str(REPO / "deploy" / "docker" / "kafka-run.sh")], env=env, check=True, timeout=30)
    fmt = (tmp_path / "java.log").read_text().splitlines()[0]
    password = (secrets / "operator.password").read_text()
    assert f"--add-scram SCRAM-SHA-512=[name=operator,password={password}]" in fmt
    props = (tmp_path / "config" / "server.properties").read_text()
    assert "listener.name.sasl_ssl_host.scram-sha-512.sasl.jaas.config=" in props
    assert "listener.name.sasl_ssl.ssl.client.auth=none" in props
