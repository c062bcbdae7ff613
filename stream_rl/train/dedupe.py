"""The trainer's guard against training a sample twice, whatever arrives on `training-batches`.

The preprocessor emits every sample once (one transaction per poll), but a broken or replayed
producer can write a batch again, or the same rollout inside another batch. `TrainedIds` keeps
the ids of the last `capacity` samples trained and of the last `capacity // 8` batches; a batch
whose `batch_id` was seen is dropped whole (its `num_filtered` included, which would otherwise
be counted twice), and a sample whose `rollout_id` was seen is dropped from its batch. Dropped
samples are counted (`duplicates`), never trained, never counted as consumed.

Memory is fixed by `capacity` (default `trainer.dedupe_window`, 20,000 ids: 1.4 MB held from
start, `stream_rl/common/windows.py`). The guarantee is "at most once among the last `capacity`
samples": duplicates come from re-delivery, which arrives within a few steps of the original.
The windows are part of every checkpoint
(`dedupe.json`), so a restarted trainer, which re-consumes from its checkpoint's offsets, takes
the same decisions as an uninterrupted one; `replay trainer` starts empty at offset 0 and so
reproduces them too.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from stream_rl.common.windows import RecentIds
from stream_rl.contracts import TrainingBatch

FILE = "dedupe.json"


class TrainedIds:
    """See the module docstring."""

    def __init__(self, capacity: int = 20_000) -> None:
        self.samples = RecentIds(capacity)
        self.batches = RecentIds(max(capacity // 8, 1))
        # The step being filled: its ids join the windows when the step is taken, so that a step
        # abandoned at SIGTERM (re-read after the restart) leaves no trace in a checkpoint.
        self._step_samples: dict[str, None] = {}
        self._step_batches: dict[str, None] = {}

    def filter(self, batch: TrainingBatch) -> tuple[TrainingBatch | None, int]:
        """The batch without the samples already trained (None: nothing left to account for),
        and how many samples were dropped as duplicates."""
        if batch.batch_id in self.batches or batch.batch_id in self._step_batches:
            return None, batch.num_samples
        self._step_batches[batch.batch_id] = None
        kept = []
        for s in batch.samples:
            if s.rollout_id in self.samples or s.rollout_id in self._step_samples:
                continue
            self._step_samples[s.rollout_id] = None
            kept.append(s)
        dropped = batch.num_samples - len(kept)
        if not dropped:
            return batch, 0
        if not kept and not batch.num_filtered:
            return None, dropped
        return dataclasses.replace(batch, samples=kept), dropped

    def step_taken(self) -> None:
        """The step holding the ids filtered since the last call was taken: remember them."""
        for i in self._step_batches:
            self.batches.add(i)
        for i in self._step_samples:
            self.samples.add(i)
        self._step_batches.clear()
        self._step_samples.clear()

    def save(self, directory: Path) -> None:
        """Write the windows of the steps taken (not the step being filled) into a checkpoint."""
        data = {
            "capacity": self.samples.capacity,
            "samples": self.samples.ids(),
            "batches": self.batches.ids(),
        }
        (directory / FILE).write_text(json.dumps(data))

    @classmethod
    def load(cls, directory: Path | None, capacity: int) -> TrainedIds:
        """The windows saved in a checkpoint (empty for none, or a checkpoint older than them)."""
        out = cls(capacity)
        path = None if directory is None else directory / FILE
        if path is not None and path.is_file():
            data = json.loads(path.read_text())
            out.samples = RecentIds(capacity, data["samples"])
            out.batches = RecentIds(max(capacity // 8, 1), data["batches"])
        return out
