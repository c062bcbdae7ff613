"""The preprocessor's partial groups, one `PartitionGroups` per assigned `scored` partition, and
the step from a complete group to training samples.

State of a partition (persisted in the compacted `preprocessor-state` topic, same partition
number, key = group_id, written in the transaction that consumed the samples):
- open groups: the samples received so far (the consumed record bytes and offsets);
- closed groups: the ids of the last `window` groups emitted or dead-lettered, so that a late
  duplicate (an actor or a verifier that re-delivered after a crash) is dropped, not grouped
  again. A marker evicted from the window is tombstoned.

`add()` drops a sample whose rollout_id the group already holds, or whose group is closed
(counted as duplicates). A group is complete when it holds `group_size` distinct samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from stream_rl.common.windows import RecentIds
from stream_rl.config import PreprocessorConfig
from stream_rl.contracts import PartialGroup, PendingSample, ScoredRollout, TrainingSample
from stream_rl.kafka.serde import Serde
from stream_rl.rl.advantages import compute_advantages


class Added(Enum):
    ADDED = "added"
    COMPLETE = "complete"
    DUPLICATE = "duplicate"
    MISMATCH = "mismatch"
    """The sample's group_size differs from its group's: a broken producer."""


@dataclass
class OpenGroup:
    group_size: int
    first_seen_ms: int
    samples: dict[str, tuple[ScoredRollout, PendingSample]] = field(default_factory=dict)

    def scored(self) -> list[ScoredRollout]:
        return sorted((s for s, _ in self.samples.values()), key=lambda s: s.rollout.sample_index)


class PartitionGroups:
    def __init__(self, partition: int, window: int) -> None:
        self.partition = partition
        self.window = window
        self.open: dict[str, OpenGroup] = {}
        self.closed = RecentIds(window)
        """The ids of the last `window` groups closed (memory fixed at start)."""

    # -- rebuilding from the state topic -------------------------------------------------------
    def restore(self, group_id: str, record: PartialGroup | None, serde: Serde) -> None:
        """Apply one state record (None: a tombstone) in offset order."""
        self.open.pop(group_id, None)
        self.closed.discard(group_id)
        if record is None:
            return
        if record.closed:
            self.closed.add(group_id)  # an id it evicts was tombstoned when it was evicted live
            return
        samples = {}
        group_size = 0
        for pending in record.samples:
            scored = serde.decode(pending.record, ScoredRollout)
            group_size = scored.rollout.group_size
            samples[pending.rollout_id] = (scored, pending)
        if samples:
            self.open[group_id] = OpenGroup(group_size, record.first_seen_ms, samples)

    # -- consuming -----------------------------------------------------------------------------
    def add(self, scored: ScoredRollout, pending: PendingSample, now_ms: int) -> Added:
        r = scored.rollout
        if r.group_id in self.closed:
            return Added.DUPLICATE
        group = self.open.get(r.group_id)
        if group is None:
            group = self.open[r.group_id] = OpenGroup(r.group_size, now_ms)
        elif group.group_size != r.group_size:
            return Added.MISMATCH
        if r.rollout_id in group.samples:
            return Added.DUPLICATE
        group.samples[r.rollout_id] = (scored, pending)
        return Added.COMPLETE if len(group.samples) >= group.group_size else Added.ADDED

    def close(self, group_id: str) -> tuple[OpenGroup | None, list[str]]:
        """Close a group: returns it and the closed ids evicted from the window (to tombstone)."""
        group = self.open.pop(group_id, None)
        evicted = self.closed.add(group_id)
        return group, [] if evicted is None else [evicted]

    def expired(self, now_ms: int, timeout_ms: float) -> list[str]:
        return [gid for gid, g in self.open.items() if now_ms - g.first_seen_ms >= timeout_ms]

    # -- state records -------------------------------------------------------------------------
    def open_record(self, group_id: str, now_ms: int) -> PartialGroup:
        group = self.open[group_id]
        return PartialGroup(
            group_id=group_id,
            partition=self.partition,
            closed=False,
            samples=[p for _, p in sorted(group.samples.values(), key=lambda sp: sp[1].offset)],
            first_seen_ms=group.first_seen_ms,
            updated_ms=now_ms,
        )

    def closed_record(self, group_id: str, first_seen_ms: int, now_ms: int) -> PartialGroup:
        return PartialGroup(
            group_id=group_id,
            partition=self.partition,
            closed=True,
            samples=[],
            first_seen_ms=first_seen_ms,
            updated_ms=now_ms,
        )


def group_advantages(group: list[ScoredRollout], cfg: PreprocessorConfig) -> list[float]:
    """One advantage per sample (exact zeros when the rewards are equal: the filter's test)."""
    return compute_advantages([s.reward for s in group], cfg.advantage, cfg.divide_by_std)


def training_samples(group: list[ScoredRollout], advantages: list[float]) -> list[TrainingSample]:
    """One complete group's samples, in sample order, with per-token advantages: the sample's
    advantage on the tokens the model sampled (the loss mask: every sampled completion token, the
    end-of-sequence token included; environment tokens of multi-turn rollouts excluded), 0
    elsewhere."""
    out = []
    for s, adv in zip(group, advantages, strict=True):
        r = s.rollout
        mask = r.sampled_mask()
        out.append(
            TrainingSample(
                rollout_id=r.rollout_id,
                group_id=r.group_id,
                input_ids=list(r.prompt_token_ids) + list(r.completion_token_ids),
                prompt_len=len(r.prompt_token_ids),
                loss_mask=mask,
                advantages=[adv if m else 0.0 for m in mask],
                behaviour_logprobs=list(r.logprobs),
                version_spans=list(r.version_spans),
                reward=s.reward,
                verdict=s.verdict,
                finish_reason=r.finish_reason,
                problem_partition=r.problem_partition,
            )
        )
    return out
