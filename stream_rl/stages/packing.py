"""Packing training samples into micro-batches (`TrainingBatch` records).

- Whole samples only, at most `max_tokens` tokens (prompt + completion) and `max_samples` samples
  per micro-batch, first-fit decreasing (longest first, each into the first batch it fits; ties keep arrival order, so the
  packing is deterministic). A sample longer than the budget travels alone.
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


def first_fit_decreasing(sizes: list[int], budget: int, max_items: int | None = None) -> list[list[int]]:
    """Indices grouped into bins of total size <= budget and at most `max_items` items (an item
    over budget gets its own bin)."""
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        size = sizes[i]
        for b, load in enumerate(loads):
            if load + size <= budget and (max_items is None or len(bins[b]) < max_items):
                bins[b].append(i)
                loads[b] += size
                break
        else:
            bins.append([i])
            loads.append(size)
    return [sorted(b) for b in bins]


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
    for b in first_fit_decreasing([len(s.input_ids) for s in samples], max_tokens, max_samples):
        out.extend(_fit([samples[i] for i in b], build, max_bytes, encode))
    if num_filtered:
        if not out:
            out.append((build([]), b""))
        first = out[0][0]
        first.num_filtered = num_filtered  # a few bytes more: the split's margin covers them
        out[0] = (first, encode(first))
    return out
