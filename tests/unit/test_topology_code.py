"""The stage modules and `topology/topics.yaml` agree: what each stage consumes (with its consumer
group named after the role), produces and follows."""

from __future__ import annotations

import importlib
import inspect

import pytest

from stream_rl.kafka.topics import WEIGHT_VERSIONS, load_topology

pytestmark = pytest.mark.unit

ROLES = ("loader", "actor", "verifier", "preprocessor", "trainer", "evaluator")


@pytest.mark.parametrize("role", ROLES)
def test_stage_consumes_and_produces_what_the_topology_says(role: str) -> None:
    mod = importlib.import_module(f"stream_rl.stages.{role}")
    specs = load_topology()
    if mod.CONSUMES is not None:
        assert role in specs[mod.CONSUMES].consumers, (role, mod.CONSUMES)
    for topic in mod.PRODUCES:
        assert specs[topic].producer == role, (role, topic)
    consumed = {name for name, s in specs.items() if role in s.consumers}
    produced = {name for name, s in specs.items() if s.producer == role}
    assert consumed == ({mod.CONSUMES} if mod.CONSUMES else set())
    assert produced == set(mod.PRODUCES)


@pytest.mark.parametrize("role", ROLES)
def test_stages_that_follow_weight_versions_are_listed_as_followers(role: str) -> None:
    source = inspect.getsource(importlib.import_module(f"stream_rl.stages.{role}"))
    follows = "VersionFollower(" in source
    assert follows == (role in load_topology()[WEIGHT_VERSIONS].followers), role


def test_preprocessor_reads_back_its_state_topic() -> None:
    from stream_rl.stages import preprocessor

    spec = load_topology()[preprocessor.STATE]
    assert "preprocessor" in spec.followers and spec.cleanup_policy == "compact"
    assert spec.value == "PartialGroup"
