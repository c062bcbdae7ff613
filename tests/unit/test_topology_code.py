"""The stages and `topology/topics.yaml` agree, as the stages really run: each stage is driven
briefly on a recording in-memory transport (fake servers, a tiny model) and the topics it
produced to, consumed in its consumer group (named after the role) and read without a group
are compared with the file. Bad input is fed too, so DLQ writes are seen."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from fakes.inference import FakeServer, factory
from fakes.recording import RecordingTransport, Touched
from fakes.records import make_rollout, make_scored, make_weight_version
from fakes.training import FakePusher, make_batches, produce_batches, stage_config
from models import cached_model

from stream_rl.config import RunConfig
from stream_rl.contracts import WeightVersionKind
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.topics import PROBLEMS, RAW_ROLLOUTS, SCORED, WEIGHT_VERSIONS, TopicNames, load_topology
from stream_rl.stages import actor, evaluator, loader, preprocessor, trainer, verifier

pytestmark = pytest.mark.unit

RUN = "r"
NAMES = TopicNames(RUN)
SERDE = default_serde()
ROLES = ("loader", "actor", "verifier", "preprocessor", "trainer", "evaluator")
CONDITIONAL_FOLLOWS = {"trainer": {"eval-results"}}
"""Read only with options this run of the stage leaves off (the trainer: `eval.every` with `eval.pin`)."""


def base_config(**sections: object) -> RunConfig:
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


def fresh() -> RecordingTransport:
    t = RecordingTransport()
    t.create_topics(NAMES.all_topics(partitions=2))
    return t


def publish_version(t: RecordingTransport, version: int = 0) -> None:
    wv = replace(make_weight_version(version, run_id=RUN), servers_updated=["http://a"])
    t.producer("setup").produce(NAMES[WEIGHT_VERSIONS], SERDE.encode(wv), key=RUN)


def run_loader(tmp: Path) -> Touched:
    t = fresh()
    loader.run(base_config(), transport=t)
    return t.touched


def run_actor(tmp: Path) -> Touched:
    t = fresh()
    loader.run(base_config(), transport=t)
    t.producer("setup").produce(NAMES[PROBLEMS], b"not a problem", key="x")
    publish_version(t)
    t.forget()
    servers = [FakeServer("http://a", version=0)]
    actor.run(base_config(), transport=t, client_factory=factory(servers), max_records=5, idle_timeout_s=5)
    return t.touched


def run_verifier(tmp: Path) -> Touched:
    t = fresh()
    p = t.producer("setup")
    r = make_rollout(0, 0, run_id=RUN)
    p.produce(NAMES[RAW_ROLLOUTS], SERDE.encode(r), key=r.group_id)
    p.produce(NAMES[RAW_ROLLOUTS], b"not a rollout", key="x")
    t.forget()
    verifier.run(base_config(), transport=t, max_records=2, idle_timeout_s=5)
    return t.touched


def run_preprocessor(tmp: Path) -> Touched:
    """Twice: the second run rebuilds the open group the first left in its state topic."""
    t = fresh()
    publish_version(t)
    first, second = (make_scored(0, k, 2, reward=float(k)) for k in range(2))
    p = t.producer("setup")
    p.produce(NAMES[SCORED], SERDE.encode(first), key=first.rollout.group_id)
    p.produce(NAMES[SCORED], b"not scored", key="x")
    t.forget()
    preprocessor.run(base_config(), transport=t, max_records=2, idle_timeout_s=5)
    p.produce(NAMES[SCORED], SERDE.encode(second), key=second.rollout.group_id)
    preprocessor.run(base_config(), transport=t, max_records=1, idle_timeout_s=5)
    return t.touched


def run_trainer(tmp: Path) -> Touched:
    """Twice: the second start resumes from the first's checkpoint and reads the run's lineage."""
    t = fresh()
    produce_batches(t, NAMES, [b"not a batch", *make_batches(4, 2, run_id=RUN)])
    t.forget()
    model = cached_model("tiny")
    for steps in (1, 2):
        trainer.run(
            stage_config(tmp, model, run=RUN, max_steps=steps), t, pusher=FakePusher(), idle_timeout_s=5
        )
    return t.touched


def run_evaluator(tmp: Path) -> Touched:
    t = fresh()
    final = replace(
        make_weight_version(1, run_id=RUN), kind=WeightVersionKind.FINAL, servers_updated=["http://a"]
    )
    t.producer("setup").produce(NAMES[WEIGHT_VERSIONS], SERDE.encode(final), key=RUN)
    t.forget()
    servers = [FakeServer("http://a", version=1)]
    evaluator.run(
        base_config(), transport=t, client_factory=factory(servers), max_records=1, idle_timeout_s=5
    )
    return t.touched


STAGES = {
    "loader": loader,
    "actor": actor,
    "verifier": verifier,
    "preprocessor": preprocessor,
    "trainer": trainer,
    "evaluator": evaluator,
}
RUNS = {
    "loader": run_loader,
    "actor": run_actor,
    "verifier": run_verifier,
    "preprocessor": run_preprocessor,
    "trainer": run_trainer,
    "evaluator": run_evaluator,
}


def logical(topics: set[str]) -> set[str]:
    prefix = f"{NAMES.prefix}.{RUN}."
    assert all(t.startswith(prefix) for t in topics), topics
    return {t.removeprefix(prefix) for t in topics}


@pytest.mark.parametrize("role", ROLES)
def test_a_stage_touches_the_topics_the_topology_names(role: str, tmp_path: Path) -> None:
    specs = load_topology()
    touched = RUNS[role](tmp_path)
    produced = logical(touched.produced)
    dlqs = {t for t in produced if t.endswith(".dlq")}
    assert produced - dlqs == {name for name, s in specs.items() if s.producer == role}
    consumed = {name for name, s in specs.items() if role in s.consumers}
    assert {g: logical(ts) for g, ts in touched.consumed.items()} == (
        {NAMES.group(role): consumed} if consumed else {}
    )
    # Bad records of what it consumes go to that topic's DLQ, and only there.
    assert dlqs == {f"{name}.dlq" for name in consumed if specs[name].dlq}
    # The module's declarations say the same.
    mod = STAGES[role]
    assert set(mod.PRODUCES) == produced - dlqs and ({mod.CONSUMES} if mod.CONSUMES else set()) == consumed
    followed = {name for name, s in specs.items() if role in s.followers}
    assert logical(touched.followed) | CONDITIONAL_FOLLOWS.get(role, set()) == followed


def test_the_preprocessor_state_topic_is_compacted_partial_groups() -> None:
    spec = load_topology()[preprocessor.STATE]
    assert spec.cleanup_policy == "compact" and spec.value == "PartialGroup"
