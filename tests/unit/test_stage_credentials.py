"""Per-stage Kafka credentials (`kafka.credentials`): each kind of process's own laid over the shared
properties, one-line errors for what cannot be right, and the launcher handing each stage its own
secret only (its config file and its environment), while its own clients act as the launcher."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from stream_rl.config import load_config
from stream_rl.errors import ConfigError
from stream_rl.kafka.acls import STAGES
from stream_rl.kafka.stage import StopFlag
from stream_rl.run.children import FORK_SERVER, child_env
from stream_rl.run.launch import Launcher

pytestmark = pytest.mark.unit

SHARED = {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512", "ssl.ca.location": "/ca.pem"}


def _config(tmp_path: Path, by_env: bool = False) -> Path:
    creds = {}
    for role in (*STAGES, "launcher", "operator"):
        ref = f"${{KAFKA_PW_{role.upper()}}}" if by_env else f"file:{tmp_path}/{role}.password"
        creds[role] = {
            "client_properties": {"sasl.username": f"r-{role}"},
            "secret_properties": {"sasl.password": ref},
        }
        (tmp_path / f"{role}.password").write_text(f"pw-of-{role}\n")
    data = {
        "run": "r",
        "runs_dir": str(tmp_path / "runs"),
        "kafka": {
            "bootstrap": "127.0.0.1:1",
            "client_properties": SHARED,
            "principals": {role: f"User:r-{role}" for role in creds},
            "credentials": creds,
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_kind_sees_its_own_credentials_over_the_shared_ones(tmp_path: Path) -> None:
    kafka = load_config(_config(tmp_path)).kafka
    actor = kafka.for_role("actor")
    assert actor.credentials == {}
    assert actor.client_properties == {**SHARED, "sasl.username": "r-actor"}
    props = actor.librdkafka_properties()
    assert props["sasl.password"].get_secret_value() == "pw-of-actor"  # type: ignore[union-attr]
    # Commands that are no stage (status, lag, topics) use the operator's; the launcher its own.
    assert kafka.librdkafka_properties()["sasl.username"] == "r-operator"
    assert kafka.acting_as("launcher").librdkafka_properties()["sasl.username"] == "r-launcher"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "kafka.credentials.mallory.client_properties.sasl.username=x",
            "kafka.credentials.mallory: no such kind",
        ),
        (
            "kafka.credentials.actor.secret_properties.sasl.password=hunter2",
            "kafka.credentials.actor.secret_properties: sasl.password: give a reference",
        ),
        (
            "kafka.credentials.actor.client_properties.sasl.password=hunter2",
            "kafka.credentials.actor.client_properties: sasl.password holds a secret",
        ),
        (
            "kafka.credentials.actor.client_properties.sasl.username=r-trainer",
            "kafka.credentials.actor: sasl.username r-trainer is not kafka.principals.actor (User:r-actor)",
        ),
        (
            "kafka.credentials.actor.client_properties.acks=0",
            "kafka.credentials.actor.client_properties: acks",
        ),
    ],
)
def test_bad_credentials_are_one_line_errors(tmp_path: Path, override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(_config(tmp_path), [override])
    assert message in str(err.value) and "\n" not in str(err.value)
    assert "hunter2" not in str(err.value)


def test_a_kind_without_credentials_is_refused_when_others_have_some(tmp_path: Path) -> None:
    kafka = load_config(_config(tmp_path)).kafka
    kafka = kafka.model_copy(
        update={"credentials": {k: v for k, v in kafka.credentials.items() if k != "loader"}}
    )
    with pytest.raises(ConfigError, match="kafka.credentials has no entry for loader"):
        kafka.for_role("loader")


def test_the_launcher_gives_each_stage_its_own_secret_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for role in (*STAGES, "launcher", "operator"):
        monkeypatch.setenv(f"KAFKA_PW_{role.upper()}", f"pw-of-{role}")
    config = load_config(_config(tmp_path, by_env=True))
    launcher = Launcher(config, StopFlag())
    assert launcher.config.kafka.librdkafka_properties()["sasl.username"] == "r-launcher"
    for role in STAGES:
        child = launcher.add_stage(role, 0)
        written = (child.dir / "config.yaml").read_text()
        seen = load_config(child.dir / "config.yaml").kafka
        assert seen.credentials == {}
        assert seen.client_properties["sasl.username"] == f"r-{role}"
        assert seen.secret_properties == {"sasl.password": f"${{KAFKA_PW_{role.upper()}}}"}
        env = child_env(launcher.config, role=child.role)
        assert env[f"KAFKA_PW_{role.upper()}"] == f"pw-of-{role}"
        for other in (*STAGES, "launcher", "operator"):
            if other != role:
                # (the principals' names are no secret: `acls` reads them from any process's config)
                assert (
                    f"sasl.username: r-{other}" not in written and f"KAFKA_PW_{other.upper()}" not in written
                )
                assert f"KAFKA_PW_{other.upper()}" not in env  # nor its secret in the environment
                assert f"pw-of-{other}" not in env.values()
    forks = child_env(launcher.config, role=FORK_SERVER)  # the stages' parent when they are forked
    assert not [k for k in forks if k.startswith("KAFKA_PW_")]
