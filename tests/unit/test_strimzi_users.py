"""`stream-rl acls plan --strimzi CLUSTER`: the plan as Strimzi KafkaUsers, one per principal, with
exactly its rows (regrouped by resource, nothing widened). deploy/k8s/users.yaml is checked against
it in tests/unit/test_k8s.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from stream_rl.cli import main as cli_main
from stream_rl.errors import ConfigError
from stream_rl.kafka.acls import Acl, PlannedAcl, plan_acls
from stream_rl.kafka.strimzi import OPERATION, PATTERN, RESOURCE, kafka_users
from stream_rl.kafka.topics import TopicNames

pytestmark = pytest.mark.unit

PRINCIPALS = {"actor": "User:r-actor", "preprocessor": "User:r-preprocessor", "operator": "User:ops"}


def _rows_back(user: dict) -> set[tuple[str, str, str, str]]:
    """The (type, name, pattern, operation) rows a KafkaUser's rules grant."""
    back = {v: k for k, v in RESOURCE.items()}
    pattern = {v: k for k, v in PATTERN.items()}
    ops = {v: k for k, v in OPERATION.items()}
    return {
        (back[r["resource"]["type"]], r["resource"].get("name", "kafka-cluster"),
         pattern[r["resource"].get("patternType", "literal")], ops[op])
        for r in user["spec"]["authorization"]["acls"]
        for op in r["operations"]
    }  # fmt: skip


def test_each_principal_becomes_a_user_with_exactly_its_rows() -> None:
    rows = plan_acls(TopicNames("r"), PRINCIPALS)
    users = {u["metadata"]["name"]: u for u in kafka_users(rows, "c")}
    assert set(users) == {"r-actor", "r-preprocessor", "ops"}
    for role, principal in PRINCIPALS.items():
        user = users[principal.removeprefix("User:")]
        assert user["metadata"]["labels"] == {"strimzi.io/cluster": "c", "stream-rl/role": role}
        want = {
            (r.acl.resource_type, r.acl.name, r.acl.pattern_type, r.acl.operation)
            for r in rows
            if r.role == role
        }
        assert _rows_back(user) == want
    txn = [
        r
        for r in users["r-preprocessor"]["spec"]["authorization"]["acls"]
        if r["resource"]["type"] == "transactionalId"
    ]
    assert txn == [
        {
            "resource": {
                "type": "transactionalId",
                "name": "stream-rl.r.preprocessor.",
                "patternType": "prefix",
            },
            "operations": ["Describe", "Write"],
        }
    ]


def test_a_principal_strimzi_cannot_name_is_one_line() -> None:
    row = PlannedAcl("actor", Acl("Group:x", "TOPIC", "t", "LITERAL", "READ"))
    with pytest.raises(ConfigError, match="a Strimzi KafkaUser is a User:<name> principal"):
        kafka_users([row], "c")


def test_the_cli_prints_the_users(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"run": "r", "kafka": {"principals": PRINCIPALS}}))
    assert cli_main(["acls", "plan", "--config", str(path), "--strimzi", "c"]) == 0
    printed = list(yaml.safe_load_all(capsys.readouterr().out))
    assert printed == kafka_users(plan_acls(TopicNames("r"), PRINCIPALS), "c")
