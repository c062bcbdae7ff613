"""The ACL plan (`stream_rl.kafka.acls`) as Strimzi `KafkaUser` resources, one per principal:
`stream-rl acls plan --config run.yaml --strimzi CLUSTER` prints them (deploy/k8s/users.yaml is
that output for the Kubernetes run). Strimzi creates each user's SCRAM-SHA-512 password in a Secret
of the user's name (key `password`); a pod mounts its own kind's Secret only.

Each user's rules group the plan's operations by resource; nothing is added or widened (a
principal must be `User:<name>`: Strimzi names the user, its Secret and the principal alike).
"""

from __future__ import annotations

from typing import Any

import yaml

from stream_rl.errors import ConfigError
from stream_rl.kafka.acls import PlannedAcl

RESOURCE = {"TOPIC": "topic", "GROUP": "group", "TRANSACTIONAL_ID": "transactionalId", "CLUSTER": "cluster"}
PATTERN = {"LITERAL": "literal", "PREFIXED": "prefix"}
OPERATION = {
    "READ": "Read",
    "WRITE": "Write",
    "CREATE": "Create",
    "DELETE": "Delete",
    "ALTER": "Alter",
    "DESCRIBE": "Describe",
    "DESCRIBE_CONFIGS": "DescribeConfigs",
    "ALTER_CONFIGS": "AlterConfigs",
    "IDEMPOTENT_WRITE": "IdempotentWrite",
    "CLUSTER_ACTION": "ClusterAction",
}


def user_name(principal: str) -> str:
    kind, _, name = principal.partition(":")
    if kind != "User" or not name:
        raise ConfigError(f"{principal}: a Strimzi KafkaUser is a User:<name> principal")
    return name


def acl_rules(rows: list[PlannedAcl]) -> list[dict[str, Any]]:
    """Strimzi's `spec.authorization.acls` of one principal's rows: one rule per resource."""
    grouped: dict[tuple[str, str, str], set[str]] = {}
    for row in rows:
        a = row.acl
        if a.permission != "ALLOW" or a.host != "*":
            raise ConfigError(f"not expressible as a Strimzi allow rule for any host: {a}")
        grouped.setdefault((a.resource_type, a.name, a.pattern_type), set()).add(OPERATION[a.operation])
    rules = []
    for (rtype, name, pattern), ops in sorted(grouped.items()):
        resource: dict[str, str] = {"type": RESOURCE[rtype]}
        if rtype != "CLUSTER":
            resource |= {"name": name, "patternType": PATTERN[pattern]}
        rules.append({"resource": resource, "operations": sorted(ops)})
    return rules


def kafka_users(rows: list[PlannedAcl], cluster: str) -> list[dict[str, Any]]:
    """One `KafkaUser` per principal of the plan (in the plan's order), SCRAM-SHA-512, its rules."""
    by_principal: dict[str, tuple[list[str], list[PlannedAcl]]] = {}
    for row in rows:
        roles, own = by_principal.setdefault(row.acl.principal, ([], []))
        if row.role not in roles:
            roles.append(row.role)
        own.append(row)
    users = []
    for principal, (roles, own) in by_principal.items():
        users.append(
            {
                "apiVersion": "kafka.strimzi.io/v1beta2",
                "kind": "KafkaUser",
                "metadata": {
                    "name": user_name(principal),
                    "labels": {"strimzi.io/cluster": cluster, "stream-rl/role": "-".join(roles)},
                },
                "spec": {
                    "authentication": {"type": "scram-sha-512"},
                    "authorization": {"type": "simple", "acls": acl_rules(own)},
                },
            }
        )
    return users


def users_yaml(rows: list[PlannedAcl], cluster: str, header: str = "") -> str:
    """The users as a multi-document YAML file."""
    body = yaml.safe_dump_all(kafka_users(rows, cluster), sort_keys=False, explicit_start=True)
    return header + body
