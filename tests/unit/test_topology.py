"""The topology file is data, and tested: it must agree with the schemas and the naming code."""

from __future__ import annotations

import pytest

from stream_rl.contracts import CONTRACTS
from stream_rl.kafka.topics import (
    PROBLEMS,
    RAW_ROLLOUTS,
    SCHEMAS,
    SCORED,
    TRAINING_BATCHES,
    WEIGHT_VERSIONS,
    TopicNames,
    load_topology,
)

pytestmark = pytest.mark.unit

NON_CONTRACT_VALUES = {"schema-json"}


def test_topology_has_the_design_topics() -> None:
    specs = load_topology()
    for name in (PROBLEMS, RAW_ROLLOUTS, SCORED, TRAINING_BATCHES, WEIGHT_VERSIONS, SCHEMAS):
        assert name in specs


def test_values_are_contracts() -> None:
    for spec in load_topology().values():
        assert spec.value in CONTRACTS or spec.value in NON_CONTRACT_VALUES, spec


def test_design_keys_and_policies() -> None:
    specs = load_topology()
    assert specs[PROBLEMS].key == "problem_id"
    assert specs[RAW_ROLLOUTS].key == specs[SCORED].key == "group_id"
    assert specs[TRAINING_BATCHES].key == "batch_id"
    assert specs[WEIGHT_VERSIONS].retention_ms == -1
    assert specs[SCHEMAS].cleanup_policy == "compact"
    assert specs["preprocessor-state"].partitions == specs[SCORED].partitions


def test_names_are_namespaced_and_dlqs_exist() -> None:
    names = TopicNames(run="r1", prefix="p")
    assert names[SCORED] == "p.r1.scored"
    assert names.dlq(SCORED) == "p.r1.scored.dlq"
    assert names[SCHEMAS] == "p._schemas"
    assert names.group("actor") == "p.r1.actor"
    all_names = {t[0] for t in names.all_topics()}
    for spec in load_topology().values():
        assert names[spec.name] in all_names
        assert (names.dlq(spec.name) in all_names) == spec.dlq


def test_partition_override_keeps_single_partition_topics_single() -> None:
    parts = {t[0]: t[1] for t in TopicNames(run="r").all_topics(partitions=3)}
    assert parts["stream-rl.r.scored"] == 3
    assert parts["stream-rl.r.preprocessor-state"] == 3
    assert parts["stream-rl.r.training-batches"] == 1
    assert parts["stream-rl.r.weight-versions"] == 1


def test_readme_table_is_the_rendered_topology() -> None:
    from pathlib import Path

    from stream_rl.kafka.topics import topology_markdown

    readme = (Path(__file__).resolve().parents[2] / "docs" / "concepts.md").read_text()
    block = readme.split("<!-- topology:begin -->\n")[1].split("\n<!-- topology:end -->")[0]
    assert block == topology_markdown(), (
        "docs/concepts.md's topic table is stale: paste `stream-rl topics table`"
    )
