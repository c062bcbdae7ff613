"""Packing training samples into micro-batches (`TrainingBatch` records).

- Whole samples only, at most `max_tokens` tokens (prompt + completion) and `max_samples` samples
  per micro-batch, **in arrival order** (next fit: a batch is closed when the next sample does not
  fit; a sample longer than the budget travels alone). Order matters more than fill here: the
  trainer steps once per `samples_per_step` samples of the stream, so a sample packed behind
  younger ones can fall into the next step and exceed the lag bound (first-fit decreasing did
  that once a backlog formed: lag 3 with `max_lag: 2`). The trainer packs its rows itself
  (`stream_rl/train/rows.py`), so the micro-batches' fill costs nothing but record count.
- Each encoded record stays under `max_bytes`: a pack whose encoding is larger is split in
  halves until it fits (a single sample that is still larger travels alone and is logged; the
  topic accepts up to its `max.message.bytes`).
- `num_filtered` (samples of dropped zero-advantage groups) rides on the first batch; when there
  is no batch, an empty one carries it, so the trainer's `samples_consumed` counts them.
- `batch_id` is a digest of the batch's rollout ids (or of the filtered group ids): replaying the
  same input gives the same ids.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable

from stream_rl.contracts import TrainingBatch, TrainingSample

log = logging.getLogger(__name__)


def next_fit(sizes: list[int], budget: int, max_items: int | None = None) -> list[list[int]]:
    """Consecutive runs of indices, in order, each of total size <= budget and at most
    `max_items` items (an item over budget gets its own bin)."""
    bins: list[list[int]] = []
    load = 0
    for i, size in enumerate(sizes):
        full = max_items is not None and bool(bins) and len(bins[-1]) >= max_items
        if not bins or full or load + size > budget:
            bins.append([i])
            load = size
        else:
            bins[-1].append(i)
            load += size
    return bins


def batch_id(keys: list[str]) -> str:
    return "b-" + hashlib.sha1("\n".join(keys).encode()).hexdigest()[:20]


def _fit(
    samples: list[TrainingSample],
    build: Callable[[list[TrainingSample]], TrainingBatch],
    max_bytes: int,
    encode: Callable[[TrainingBatch], bytes],
) -> list[tuple[TrainingBatch, bytes]]:
    batch = build(samples)
    data = encode(batch)
    if len(data) <= max_bytes:
        return [(batch, data)]
    if len(samples) == 1:
        log.warning(
            "sample %s alone encodes to %d bytes (> %d): written as one record",
            samples[0].rollout_id,
            len(data),
            max_bytes,
        )
        return [(batch, data)]
    half = len(samples) // 2
    return _fit(samples[:half], build, max_bytes, encode) + _fit(samples[half:], build, max_bytes, encode)


def pack(
    samples: list[TrainingSample],
    *,
    max_tokens: int,
    max_bytes: int,
    num_filtered: int,
    filtered_by_partition: dict[int, int] | None = None,
    max_samples: int | None = None,
    filtered_keys: list[str],
    encode: Callable[[TrainingBatch], bytes],
    run_id: str,
    producer_id: str,
) -> list[tuple[TrainingBatch, bytes]]:
    """The micro-batches of one transaction's complete groups, each with its encoded bytes."""

    def build(part: list[TrainingSample]) -> TrainingBatch:
        ids = [s.rollout_id for s in part] or ["filtered", *filtered_keys]
        return TrainingBatch(batch_id=batch_id(ids), run_id=run_id, samples=part, producer_id=producer_id)

    out: list[tuple[TrainingBatch, bytes]] = []
    for b in next_fit([len(s.input_ids) for s in samples], max_tokens, max_samples):
        out.extend(_fit([samples[i] for i in b], build, max_bytes, encode))
    if num_filtered:
        if not out:
            out.append((build([]), b""))
        first = out[0][0]
        first.num_filtered = num_filtered  # a few bytes more: the split's margin covers them
        first.filtered_by_partition = dict(filtered_by_partition or {})
        out[0] = (first, encode(first))
    return out
