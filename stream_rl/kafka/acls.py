"""Kafka ACLs from the topology: for the principal of each kind of process (`kafka.principals`),
exactly the rights its code uses on one run's resources, and nothing else (`stream-rl acls plan`).

Stages (rows derived from `topology/topics.yaml`, plus the reads its file cannot show):
- a topic's producer: WRITE and DESCRIBE on it;
- a consumer group's role: READ and DESCRIBE on the topic, READ on its group `<prefix>.<run>.<role>`
  (join, commit, fetch its offsets), WRITE and DESCRIBE on the topic's DLQ (its bad records);
- a follower (reads without a group): READ and DESCRIBE;
- reads the topology does not list (`READS_BEYOND_TOPOLOGY`): the loader reads `problems` to
  its end before writing (idempotence), the evaluator `eval-results` (versions already
  evaluated), the actor `problems.dlq` (admission counts dead letters by partition of origin);
- transactional ids (`TRANSACTIONAL_ID_PREFIXES`): the preprocessor's are
  `<prefix>.<run>.preprocessor.<instance>`, so PREFIXED `<prefix>.<run>.preprocessor.`, WRITE and
  DESCRIBE. No other stage is transactional (the trainer's producer is idempotent only);
- every producer is idempotent: IDEMPOTENT_WRITE on the cluster.
Stages neither publish nor read `_schemas` (the launcher and `topics apply` publish it).

Listed apart (`APART`): the launcher (`topics apply`'s CREATE / DESCRIBE / DESCRIBE_CONFIGS on
every topic of the run and `_schemas`, WRITE on `_schemas`, its followers' reads, DESCRIBE on the
consumer groups for lag) and the operator (the same creation, plus READ and DELETE on the run's
topics for `lag`, `status`, `export`, `track` and cleaning up, WRITE on `servers` for `servers
join|leave`, the topology's `servers`, `track` and `status` roles).

Not granted, on purpose: DESCRIBE on the group `<client id>.nogroup` that librdkafka looks up
for the assign-only readers (followers, `read_to_end`). They never commit; the refused lookup is
one non-fatal consumer error (GROUP_AUTHORIZATION_FAILED) that `KafkaConsumer.poll_batch` skips.
No name is ever a wildcard; the host of every row is `*` (any host).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from stream_rl.errors import ConfigError
from stream_rl.kafka import topics
from stream_rl.kafka.topics import EVAL_RESULTS, PROBLEMS, SCHEMAS, TopicNames

STAGES = ("loader", "actor", "verifier", "preprocessor", "trainer", "evaluator")
APART = ("launcher", "operator")
ROLES = STAGES + APART
OPERATOR_COMMANDS = ("servers", "track", "status")
"""Roles the topology names that are commands a person (or a deployment's hook) runs: the operator."""
ANY = "any"
"""The topology's producer of `_schemas`: whoever publishes schemas (no stage does)."""
CLUSTER = "kafka-cluster"
"""The one name of Kafka's CLUSTER resource."""

READS_BEYOND_TOPOLOGY: dict[str, tuple[tuple[str, bool], ...]] = {
    "loader": ((PROBLEMS, False),),
    "evaluator": ((EVAL_RESULTS, False),),
    "actor": ((PROBLEMS, True),),
}
"""(topic, its DLQ?) each stage reads although the topology does not name it a reader there."""
TRANSACTIONAL_ID_PREFIXES = {"preprocessor": "preprocessor."}
"""After `<prefix>.<run>.`: the preprocessor's transactional id ends with its `--instance`."""


@dataclass(frozen=True, order=True)
class Acl:
    """One ALLOW binding as Kafka stores it (the host is always `*`)."""

    principal: str
    resource_type: str
    """TOPIC, GROUP, TRANSACTIONAL_ID or CLUSTER (confluent-kafka's `ResourceType` names)."""
    name: str
    pattern_type: str
    """LITERAL or PREFIXED."""
    operation: str
    """confluent-kafka's `AclOperation` names: READ, WRITE, DESCRIBE, IDEMPOTENT_WRITE, ..."""
    permission: str = "ALLOW"
    host: str = "*"


@dataclass(frozen=True, order=True)
class PlannedAcl:
    """A binding and the kind of process it is for."""

    role: str
    acl: Acl


Right = tuple[str, str, str, str]
"""(resource type, name, pattern type, operation)."""


def _topic(name: str, *ops: str) -> set[Right]:
    return {("TOPIC", name, "LITERAL", op) for op in ops}


def _role(topology_role: str) -> str | None:
    """The kind of process a role of the topology runs as (None: `any`, no one in particular)."""
    if topology_role == ANY:
        return None
    if topology_role in OPERATOR_COMMANDS:
        return "operator"
    if topology_role not in ROLES:
        raise ConfigError(
            f"topology: role {topology_role!r} is not a kind of process with a principal "
            f"({', '.join(ROLES + OPERATOR_COMMANDS)}): add it to stream_rl/kafka/acls.py"
        )
    return topology_role


def _from_topology(role: str, names: TopicNames) -> set[Right]:
    rights: set[Right] = set()
    for spec in topics.load_topology().values():
        topic = names.topic(spec.name)
        if _role(spec.producer) == role:
            rights |= _topic(topic, "WRITE", "DESCRIBE")
        consumers = {_role(r) for r in spec.consumers}
        if role in consumers:
            rights |= _topic(topic, "READ", "DESCRIBE")
            rights.add(("GROUP", names.group(role), "LITERAL", "READ"))
            if spec.dlq:
                rights |= _topic(names.dlq(spec.name), "WRITE", "DESCRIBE")
        if role in {_role(r) for r in spec.followers}:
            rights |= _topic(topic, "READ", "DESCRIBE")
    return rights


def _creates(names: TopicNames, *ops: str) -> set[Right]:
    """`topics apply`: every topic of the run, its DLQs and `_schemas`."""
    rights: set[Right] = set()
    for name, _parts, _conf in names.all_topics():
        rights |= _topic(name, "CREATE", "DESCRIBE", "DESCRIBE_CONFIGS", *ops)
    return rights


def _lag(names: TopicNames) -> set[Right]:
    """DESCRIBE on every consumer group of the run (its committed offsets, for lag)."""
    roles = {r for spec in topics.load_topology().values() for r in spec.consumers}
    return {("GROUP", names.group(r), "LITERAL", "DESCRIBE") for r in roles}


def rights(role: str, names: TopicNames) -> set[Right]:
    """What the principal of `role` needs on the run `names` (see the module docstring)."""
    if role not in ROLES:
        raise ConfigError(f"no such kind of process: {role!r} (one of {', '.join(ROLES)})")
    out = _from_topology(role, names)
    for name, dlq in READS_BEYOND_TOPOLOGY.get(role, ()):
        out |= _topic(names.dlq(name) if dlq else names.topic(name), "READ", "DESCRIBE")
    if role in TRANSACTIONAL_ID_PREFIXES:
        txn = f"{names.prefix}.{names.run}.{TRANSACTIONAL_ID_PREFIXES[role]}"
        out |= {("TRANSACTIONAL_ID", txn, "PREFIXED", op) for op in ("WRITE", "DESCRIBE")}
    schemas = names.topic(SCHEMAS)
    if role == "launcher":
        out |= _creates(names) | _topic(schemas, "WRITE") | _lag(names)
    if role == "operator":
        out |= _creates(names) | _topic(schemas, "WRITE") | _lag(names)
        for name, _parts, _conf in names.all_topics():
            if name != schemas:  # shared by every run of the cluster: read by none, deleted by none
                out |= _topic(name, "READ", "DELETE")
    if any(r[0] == "TOPIC" and r[3] == "WRITE" for r in out):
        out.add(("CLUSTER", CLUSTER, "LITERAL", "IDEMPOTENT_WRITE"))
    return out


def plan_acls(names: TopicNames, principals: Mapping[str, str | None]) -> list[PlannedAcl]:
    """The bindings of every kind of process `principals` names (role -> principal), stages first,
    then the launcher and the operator. ConfigError when it names none."""
    named = {role: p for role, p in principals.items() if p}
    if not named:
        raise ConfigError(
            "kafka.principals names no principal: set one per kind of process, "
            "e.g. kafka.principals.actor: User:actor"
        )
    out: list[PlannedAcl] = []
    for role in ROLES:
        if role in named:
            acls = {Acl(named[role], *right) for right in rights(role, names)}
            out.extend(PlannedAcl(role, acl) for acl in sorted(acls, key=_row_order))
    for row in out:  # the rule holds whatever the topology says
        if "*" in row.acl.name or "*" in row.acl.principal:
            raise ConfigError(f"a wildcard in a planned ACL: {row}")
    return out


_TYPE_ORDER = {"CLUSTER": 0, "TOPIC": 1, "GROUP": 2, "TRANSACTIONAL_ID": 3}


def _row_order(acl: Acl) -> tuple[int, str, str]:
    return (_TYPE_ORDER.get(acl.resource_type, 9), acl.name, acl.operation)


COLUMNS = ("role", "principal", "resource type", "name", "pattern type", "operation", "permission")


def plan_table(rows: list[PlannedAcl]) -> str:
    """The plan as an aligned text table, the launcher and the operator after a blank line."""
    table: list[tuple[str, ...]] = [COLUMNS]
    for i, row in enumerate(rows):
        if row.role in APART and (i == 0 or rows[i - 1].role not in APART):
            table.append(("",) * len(COLUMNS))
        a = row.acl
        table.append(
            (row.role, a.principal, a.resource_type, a.name, a.pattern_type, a.operation, a.permission)
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table)


def plan_json(rows: list[PlannedAcl]) -> str:
    """The plan as a JSON list: one object per row, `role` plus the binding's fields."""
    return json.dumps([{"role": row.role, **asdict(row.acl)} for row in rows], indent=2)


def in_scope(acl: Acl, names: TopicNames, principals: set[str]) -> bool:
    """Whether an existing binding is on the run's resources, hence reported when not planned:
    any binding whose (literal or prefixed) name lies in the run's namespace `<prefix>.<run>.`,
    and the planned principals' bindings on the shared `_schemas` topic and the cluster."""
    namespace = f"{names.prefix}.{names.run}."
    if acl.resource_type in ("TOPIC", "GROUP", "TRANSACTIONAL_ID") and acl.name.startswith(namespace):
        return True
    shared = acl.resource_type == "CLUSTER" or (
        acl.resource_type == "TOPIC" and acl.name == names.topic(SCHEMAS)
    )
    return shared and acl.principal in principals
