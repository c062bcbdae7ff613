"""`stream-rl acls`: each principal's ACLs for the default topology, written out here by hand; no
wildcard ever; a topic added to the topology adds exactly its rows; every broker call a stage
really makes (each driven briefly on a recording in-memory transport) is allowed by its rows;
`apply` creates what is missing, reports extras, and a second apply has nothing to do."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from fakes.inference import FakeServer, factory
from fakes.recording import RecordingTransport
from fakes.records import make_eval_result, make_rollout, make_scored, make_weight_version
from fakes.training import FakePusher, make_batches, produce_batches, stage_config
from models import cached_model
from pydantic import ValidationError

from stream_rl.cli import main as cli_main
from stream_rl.config import RunConfig, load_config
from stream_rl.contracts import WeightVersionKind
from stream_rl.errors import ConfigError
from stream_rl.kafka import acls, topics
from stream_rl.kafka.acl_admin import apply_acls
from stream_rl.kafka.acls import ROLES, Acl, PlannedAcl, plan_acls, rights
from stream_rl.kafka.memory import MemoryTransport
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.topics import PROBLEMS, RAW_ROLLOUTS, SCORED, WEIGHT_VERSIONS, TopicNames, TopicSpec
from stream_rl.stages import actor, evaluator, loader, preprocessor, trainer, verifier

pytestmark = pytest.mark.unit

RUN = "r"
NAMES = TopicNames(RUN)
SERDE = default_serde()
PRINCIPALS = {role: f"User:{role}" for role in ROLES}

N = "stream-rl.r."
DATA = ["problems", "raw-rollouts", "scored", "training-batches"]  # the topics with a DLQ
OTHER = ["preprocessor-state", "weight-versions", "eval-results", "servers"]
ALL = [N + t for t in DATA + [f"{d}.dlq" for d in DATA] + OTHER]
GROUPS = [N + g for g in ("actor", "verifier", "preprocessor", "trainer")]
IDEMPOTENT = ("CLUSTER", "kafka-cluster", "LITERAL", "IDEMPOTENT_WRITE")


def t(name: str, *ops: str) -> set[tuple[str, str, str, str]]:
    return {("TOPIC", name, "LITERAL", op) for op in ops}


def g(name: str, op: str = "READ") -> set[tuple[str, str, str, str]]:
    return {("GROUP", name, "LITERAL", op)}


EXPECTED: dict[str, set[tuple[str, str, str, str]]] = {
    "loader": t(N + "problems", "WRITE", "DESCRIBE", "READ") | {IDEMPOTENT},
    "actor": t(N + "problems", "READ", "DESCRIBE")
    | g(N + "actor")
    | t(N + "problems.dlq", "WRITE", "READ", "DESCRIBE")
    | t(N + "raw-rollouts", "WRITE", "DESCRIBE")
    | t(N + "weight-versions", "READ", "DESCRIBE")
    | t(N + "servers", "READ", "DESCRIBE")
    | {IDEMPOTENT},
    "verifier": t(N + "raw-rollouts", "READ", "DESCRIBE")
    | g(N + "verifier")
    | t(N + "raw-rollouts.dlq", "WRITE", "DESCRIBE")
    | t(N + "scored", "WRITE", "DESCRIBE")
    | {IDEMPOTENT},
    "preprocessor": t(N + "scored", "READ", "DESCRIBE")
    | g(N + "preprocessor")
    | t(N + "scored.dlq", "WRITE", "DESCRIBE")
    | t(N + "training-batches", "WRITE", "DESCRIBE")
    | t(N + "preprocessor-state", "WRITE", "READ", "DESCRIBE")
    | t(N + "weight-versions", "READ", "DESCRIBE")
    | {("TRANSACTIONAL_ID", N + "preprocessor.", "PREFIXED", op) for op in ("WRITE", "DESCRIBE")}
    | {IDEMPOTENT},
    "trainer": t(N + "training-batches", "READ", "DESCRIBE")
    | g(N + "trainer")
    | t(N + "training-batches.dlq", "WRITE", "DESCRIBE")
    | t(N + "weight-versions", "WRITE", "READ", "DESCRIBE")
    | t(N + "eval-results", "READ", "DESCRIBE")
    | t(N + "servers", "READ", "DESCRIBE")
    | {IDEMPOTENT},
    "evaluator": t(N + "eval-results", "WRITE", "READ", "DESCRIBE")
    | t(N + "weight-versions", "READ", "DESCRIBE")
    | {IDEMPOTENT},
    "launcher": {r for name in ALL for r in t(name, "CREATE", "DESCRIBE", "DESCRIBE_CONFIGS")}
    | t("stream-rl._schemas", "CREATE", "DESCRIBE", "DESCRIBE_CONFIGS", "WRITE")
    | t(N + "weight-versions", "READ")
    | t(N + "eval-results", "READ")
    | {r for name in GROUPS for r in g(name, "DESCRIBE")}
    | {IDEMPOTENT},
    "operator": {
        r for name in ALL for r in t(name, "CREATE", "DESCRIBE", "DESCRIBE_CONFIGS", "READ", "DELETE")
    }
    | t("stream-rl._schemas", "CREATE", "DESCRIBE", "DESCRIBE_CONFIGS", "WRITE")
    | t(N + "servers", "WRITE")
    | {r for name in GROUPS for r in g(name, "DESCRIBE")}
    | {IDEMPOTENT},
}


def by_role(rows: list[PlannedAcl]) -> dict[str, set[tuple[str, str, str, str]]]:
    out: dict[str, set[tuple[str, str, str, str]]] = {}
    for row in rows:
        a = row.acl
        assert (a.principal, a.permission, a.host) == (PRINCIPALS[row.role], "ALLOW", "*")
        out.setdefault(row.role, set()).add((a.resource_type, a.name, a.pattern_type, a.operation))
    return out


@pytest.mark.parametrize("role", ROLES)
def test_each_principal_gets_exactly_its_hand_written_rights(role: str) -> None:
    assert by_role(plan_acls(NAMES, PRINCIPALS))[role] == EXPECTED[role]


def test_a_plan_has_no_wildcard_and_no_duplicate_for_any_namespace() -> None:
    for names in (NAMES, TopicNames("other-run", prefix="team.rl")):
        rows = plan_acls(names, PRINCIPALS)
        assert len(rows) == len(set(rows)) > 100
        for row in rows:
            assert "*" not in row.acl.name and "*" not in row.acl.principal, row
            assert row.acl.name == "kafka-cluster" or row.acl.name.startswith(f"{names.prefix}."), row
            if row.acl.pattern_type == "PREFIXED":  # only where the name really is a prefix
                assert (row.role, row.acl.resource_type) == ("preprocessor", "TRANSACTIONAL_ID")


def test_a_topic_added_to_the_topology_adds_exactly_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    before = by_role(plan_acls(NAMES, PRINCIPALS))
    specs = dict(topics.load_topology())
    specs["critiques"] = dataclasses.replace(
        specs["scored"],
        name="critiques",
        producer="verifier",
        consumers=("evaluator",),
        followers=("actor", "track"),
        dlq=True,
    )
    monkeypatch.setattr(topics, "load_topology", lambda path=None: specs)
    after = by_role(plan_acls(NAMES, PRINCIPALS))
    c, dlq, group = N + "critiques", N + "critiques.dlq", N + "evaluator"
    expected = {
        "verifier": t(c, "WRITE", "DESCRIBE"),
        "evaluator": t(c, "READ", "DESCRIBE") | g(group) | t(dlq, "WRITE", "DESCRIBE"),
        "actor": t(c, "READ", "DESCRIBE"),
        "launcher": t(c, "CREATE", "DESCRIBE", "DESCRIBE_CONFIGS")
        | t(dlq, "CREATE", "DESCRIBE", "DESCRIBE_CONFIGS")
        | g(group, "DESCRIBE"),
        "operator": t(c, "CREATE", "DESCRIBE", "DESCRIBE_CONFIGS", "READ", "DELETE")
        | t(dlq, "CREATE", "DESCRIBE", "DESCRIBE_CONFIGS", "READ", "DELETE")
        | g(group, "DESCRIBE"),
    }
    for role in ROLES:
        assert after[role] - before[role] == expected.get(role, set()), role
        assert before[role] <= after[role], role


def test_a_topology_role_without_a_principal_kind_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    specs: dict[str, TopicSpec] = dict(topics.load_topology())
    specs["x"] = dataclasses.replace(specs["scored"], name="x", producer="critic")
    monkeypatch.setattr(topics, "load_topology", lambda path=None: specs)
    with pytest.raises(ConfigError, match="role 'critic' is not a kind of process"):
        plan_acls(NAMES, PRINCIPALS)


def test_only_the_named_principals_are_planned_and_none_is_an_error() -> None:
    rows = plan_acls(NAMES, {"trainer": "User:t", "actor": None})
    assert {r.role for r in rows} == {"trainer"} and {r.acl.principal for r in rows} == {"User:t"}
    with pytest.raises(ConfigError, match="kafka.principals names no principal"):
        plan_acls(NAMES, {"actor": None})


@pytest.mark.parametrize("bad", ["User:*", "actor", ":actor", "User:act*"])
def test_the_config_refuses_wildcard_and_malformed_principals(bad: str) -> None:
    with pytest.raises(ValidationError, match="principal"):
        RunConfig.model_validate({"kafka": {"principals": {"actor": bad}}})
    with pytest.raises(ValidationError, match="extra"):
        RunConfig.model_validate({"kafka": {"principals": {"critic": "User:c"}}})


# -- the code's real behaviour ------------------------------------------------------------------


class Recorder(RecordingTransport):
    """Records, besides the topics produced to and read, the offsets listed (DESCRIBE), the groups
    whose offsets are read (DESCRIBE) and the transactional ids used."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[tuple[str, str, str]] = set()
        self.create_topics(NAMES.all_topics(partitions=2))

    def forget(self) -> None:
        super().forget()
        self.ops = set()

    def producer(self, client_id: str, transactional_id: str | None = None) -> Any:
        if transactional_id:
            self.ops.add(("TRANSACTIONAL_ID", transactional_id, "WRITE"))
        return super().producer(client_id, transactional_id)

    def watermarks(self, topic: str) -> dict[int, tuple[int, int]]:
        self.ops.add(("TOPIC", topic, "DESCRIBE"))
        return super().watermarks(topic)

    def group_offsets(self, group_id: str, topic: str) -> dict[int, int]:
        self.ops |= {("GROUP", group_id, "DESCRIBE"), ("TOPIC", topic, "DESCRIBE")}
        return super().group_offsets(group_id, topic)

    def used(self) -> set[tuple[str, str, str]]:
        out = set(self.ops) | {("TOPIC", x, "WRITE") for x in self.touched.produced}
        out |= {("TOPIC", x, "READ") for x in self.touched.followed}
        for group, names in self.touched.consumed.items():
            out |= {("GROUP", group, "READ")} | {("TOPIC", x, "READ") for x in names}
        return out

    def setup(self, topic: str, *values: Any) -> None:
        """Records written by the test, not by the stage: through an unrecorded client."""
        producer = MemoryTransport(self.broker).producer("setup")
        for v in values:
            producer.produce(topic, v if isinstance(v, bytes) else SERDE.encode(v), key="k")


def config(**sections: object) -> RunConfig:
    data = {
        "run": RUN,
        "task": {"name": "arithmetic", "params": {"num_problems": 4}},
        "actor": {"group_size": 2, "backoff_s": 0.001},
        "verifier": {"workers": 0},
        "preprocessor": {"group_timeout_s": 600},
        "inference": {"servers": [{"url": "http://a"}]},
        "eval": {"every": 1, "max_problems": 2},
        **sections,
    }
    return RunConfig.model_validate(data)


def version(v: int, kind: WeightVersionKind = WeightVersionKind.UPDATE) -> Any:
    return dataclasses.replace(make_weight_version(v, run_id=RUN), servers_updated=["http://a"], kind=kind)


def drive(role: str, rec: Recorder, tmp: Path) -> None:
    """Run the stage briefly, its inputs there first (records already present in what it reads)."""
    if role == "loader":
        loader.run(config(), transport=rec, max_records=2)
        rec.forget()
        loader.run(config(), transport=rec)  # the second run reads the first's records
    elif role == "actor":
        loader.run(config(), transport=rec)
        rec.setup(NAMES.dlq(PROBLEMS), b"a dead letter")
        rec.setup(NAMES[PROBLEMS], b"not a problem")
        rec.setup(NAMES[WEIGHT_VERSIONS], version(0))
        rec.forget()
        servers = [FakeServer("http://a", version=0)]
        actor.run(config(), transport=rec, client_factory=factory(servers), max_records=5, idle_timeout_s=5)
    elif role == "verifier":
        rec.setup(NAMES[RAW_ROLLOUTS], make_rollout(0, 0, run_id=RUN), b"not a rollout")
        rec.forget()
        verifier.run(config(), transport=rec, max_records=2, idle_timeout_s=5)
    elif role == "preprocessor":
        first, second = (make_scored(0, k, 2, reward=float(k)) for k in range(2))
        rec.setup(NAMES[WEIGHT_VERSIONS], version(0))
        rec.setup(NAMES[SCORED], first, b"not scored")
        rec.forget()
        preprocessor.run(config(), transport=rec, max_records=2, idle_timeout_s=5)
        rec.setup(NAMES[SCORED], second)
        preprocessor.run(config(), transport=rec, max_records=1, idle_timeout_s=5, instance="b")
    elif role == "trainer":
        produce_batches(rec, NAMES, [b"not a batch", *make_batches(4, 2, run_id=RUN)])
        rec.forget()
        for steps in (1, 2):
            # Its eval-results reads (eval.pin) hold it for evaluations no evaluator makes here.
            cfg = stage_config(tmp, cached_model("tiny"), run=RUN, max_steps=steps)
            trainer.run(cfg, rec, pusher=FakePusher(), idle_timeout_s=5)
    elif role == "evaluator":
        rec.setup(NAMES["eval-results"], dataclasses.replace(make_eval_result(0), run_id=RUN))
        rec.setup(NAMES[WEIGHT_VERSIONS], version(1, WeightVersionKind.FINAL))
        rec.forget()
        servers = [FakeServer("http://a", version=1)]
        evaluator.run(
            config(), transport=rec, client_factory=factory(servers), max_records=1, idle_timeout_s=5
        )


IMPLIES_DESCRIBE = {"DESCRIBE", "READ", "WRITE", "DELETE", "ALTER"}


def allowed(granted: set[tuple[str, str, str, str]], rtype: str, name: str, op: str) -> bool:
    ops = IMPLIES_DESCRIBE if op == "DESCRIBE" else {op}
    return any(
        r == rtype and o in ops and (n == name if pattern == "LITERAL" else name.startswith(n))
        for r, n, pattern, o in granted
    )


@pytest.mark.parametrize("role", acls.STAGES)
def test_every_call_a_stage_makes_is_allowed_by_its_rows(role: str, tmp_path: Path) -> None:
    rec = Recorder()
    drive(role, rec, tmp_path)
    used = rec.used()
    granted = rights(role, NAMES)
    assert used, "the stage touched nothing: the recorder missed it"
    refused = sorted(u for u in used if not allowed(granted, *u))
    assert refused == [], f"{role} does these without a row: {refused}"
    if any(op == "WRITE" and rtype == "TOPIC" for rtype, _n, op in used):
        assert IDEMPOTENT in granted
    # What the module docstring says the topology cannot show, the stage really does:
    beyond = {"loader": ("TOPIC", N + "problems", "READ"), "actor": ("TOPIC", N + "problems.dlq", "READ")}
    beyond |= {"evaluator": ("TOPIC", N + "eval-results", "READ")}
    beyond |= {"preprocessor": ("TRANSACTIONAL_ID", N + "preprocessor.b", "WRITE")}
    if role in beyond:
        assert beyond[role] in used
    assert not any(rtype == "TRANSACTIONAL_ID" for rtype, _n, _op in used) or role == "preprocessor"


# -- apply --------------------------------------------------------------------------------------


class FakeAdmin:
    """The cluster's ACLs in a set; counts the calls."""

    def __init__(self, existing: set[Acl] | None = None) -> None:
        self.acls = set(existing or ())
        self.created: list[Acl] = []
        self.deleted: list[Acl] = []

    def describe(self) -> set[Acl]:
        return set(self.acls)

    def create(self, acls: list[Acl]) -> None:
        self.created += acls
        self.acls |= set(acls)

    def delete(self, acls: list[Acl]) -> None:
        self.deleted += acls
        self.acls -= set(acls)


def test_apply_creates_what_is_missing_then_has_nothing_to_do() -> None:
    rows = plan_acls(NAMES, PRINCIPALS)
    wanted = {r.acl for r in rows}
    other_run = Acl("User:actor", "TOPIC", "stream-rl.r2.problems", "LITERAL", "READ")
    admin = FakeAdmin({next(iter(wanted)), other_run})
    first = apply_acls(admin, rows, NAMES)
    assert set(first.created) == wanted - {next(iter(wanted))}
    assert len(first.present) == 1 and first.extra == [] and admin.acls == wanted | {other_run}
    second = apply_acls(admin, rows, NAMES)
    assert (second.created, second.extra, second.deleted) == ([], [], [])
    assert len(second.present) == len(wanted) and len(admin.created) == len(wanted) - 1


def test_apply_reports_extras_on_the_run_and_deletes_them_only_when_asked() -> None:
    rows = plan_acls(NAMES, PRINCIPALS)
    wanted = {r.acl for r in rows}
    extras = {
        Acl("User:mallory", "TOPIC", N + "scored", "LITERAL", "READ"),  # a stranger on the run's topic
        Acl("User:actor", "TOPIC", N + "scored", "LITERAL", "WRITE"),  # a right the actor has no use for
        Acl("User:actor", "GROUP", N, "PREFIXED", "READ"),  # a prefix over the run's groups
        Acl("User:trainer", "CLUSTER", "kafka-cluster", "LITERAL", "ALTER"),  # a planned principal
    }
    elsewhere = {
        Acl("User:mallory", "TOPIC", "stream-rl.r2.scored", "LITERAL", "READ"),  # another run
        Acl("User:mallory", "CLUSTER", "kafka-cluster", "LITERAL", "ALTER"),  # not a planned principal
        Acl("User:actor", "TOPIC", "stream-rl.r-2.scored", "LITERAL", "READ"),  # run r-2, not r
    }
    admin = FakeAdmin(wanted | extras | elsewhere)
    report = apply_acls(admin, rows, NAMES)
    assert set(report.extra) == extras and report.created == [] and admin.deleted == []
    report = apply_acls(admin, rows, NAMES, delete_extra=True)
    assert set(report.deleted) == extras and report.extra == []
    assert admin.acls == wanted | elsewhere
    assert apply_acls(admin, rows, NAMES).extra == []


def _config_file(tmp_path: Path) -> Path:
    lines = [f"run: {RUN}", "kafka:", "  principals:"] + [f"    {r}: User:{r}" for r in ("actor", "trainer")]
    path = tmp_path / "run.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_plan_prints_a_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _config_file(tmp_path)
    assert cli_main(["acls", "plan", "--config", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "role",
        "principal",
        "resource",
        "type",
        "name",
        "pattern",
        "type",
        "operation",
        "permission",
    ]
    cells = [line.split() for line in lines[1:]]
    assert ["actor", "User:actor", "GROUP", "stream-rl.r.actor", "LITERAL", "READ", "ALLOW"] in cells
    assert {c[0] for c in cells} == {"actor", "trainer"} and all(len(c) == 7 for c in cells)
    assert len(cells) == len(EXPECTED["actor"]) + len(EXPECTED["trainer"])
    assert cli_main(["acls", "plan", "--config", str(path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    cfg = load_config(path)
    assert [PlannedAcl(r.pop("role"), Acl(**r)) for r in rows] == plan_acls(
        NAMES, cfg.kafka.principals.model_dump()
    )


def test_acls_without_a_config_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["acls", "plan"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: acls: pass --config") and err.count("\n") == 1
