"""Typed Python classes for the Avro contracts in `schemas/*.avsc` (namespace `stream_rl.v1`).

Each class maps one record with explicit `to_dict()` / `from_dict()` adapters; stages build
these objects, never wire dicts. `validate()` checks what Avro cannot (aligned array lengths,
ordered version spans); the serde calls it on both sides, so an invalid record never reaches
a stage: it goes to the DLQ instead.

Split by role: `core` (protocol, enums, version spans), `records` (the rollout path),
`versions` (weight versions), `evals` (eval results), `membership` (servers joining a run), `state` (the preprocessor's state).
"""

from __future__ import annotations

from stream_rl.contracts.core import (
    ChatMessage,
    Contract,
    Verdict,
    VersionSpan,
    WeightVersionKind,
    now_ms,
    token_versions,
    validate_spans,
)
from stream_rl.contracts.evals import EvalResult
from stream_rl.contracts.membership import MembershipState, ServerMembership
from stream_rl.contracts.records import Problem, Rollout, ScoredRollout, TrainingBatch, TrainingSample
from stream_rl.contracts.state import PartialGroup, PendingSample
from stream_rl.contracts.versions import PartitionOffset, WeightVersion

CONTRACTS: dict[str, type[Contract]] = {
    cls.SCHEMA: cls
    for cls in (
        Problem,
        Rollout,
        ScoredRollout,
        TrainingBatch,
        WeightVersion,
        PartialGroup,
        EvalResult,
        ServerMembership,
    )
}

__all__ = [
    "CONTRACTS",
    "ChatMessage",
    "Contract",
    "EvalResult",
    "MembershipState",
    "PartialGroup",
    "PartitionOffset",
    "PendingSample",
    "Problem",
    "Rollout",
    "ScoredRollout",
    "ServerMembership",
    "TrainingBatch",
    "TrainingSample",
    "Verdict",
    "VersionSpan",
    "WeightVersion",
    "WeightVersionKind",
    "now_ms",
    "token_versions",
    "validate_spans",
]
