"""Duplicate windows in memory fixed at start: the last `capacity` keys a stage took.

A duplicate check over a long run needs a window of recent keys. Held as Python objects (an
`OrderedDict` of strings or tuples) such a window costs ~150-280 bytes a key and grows until it is
full: the actor's memory crept for half an hour, the preprocessor's for the minutes its closed-group
windows took to fill. Here a window is numpy arrays allocated, and touched, at construction, written
as a ring, so the process's memory does not move after start-up:

- `RecentKeys` (the actor's): a 64-bit BLAKE2b digest of each key and an int with it (16 bytes a
  slot). The keys themselves are not kept.
- `RecentIds` (the preprocessor's closed groups, the trainer's trained samples and batches): the
  digests and the ids themselves (`width` bytes a slot, UTF-8), because their owners need the ids
  back: the preprocessor tombstones the ids it evicts, the trainer writes its window into every
  checkpoint. An id longer than `width` bytes is held in a side table of at most `capacity`
  entries (ids are short in practice: `arithmetic-90+43.e2.s0`).

A lookup compares the digest with every slot (vectorised: ~10 us for 20,000 slots), which is cheap
at the rates keys arrive (problems, groups, samples; not tokens). Two distinct keys share a digest
with probability ~n^2 / 2^65 for n keys in the window (1e-11 for 20,000): such a key would be taken
for a duplicate of the other.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

EMPTY = np.uint64(0)
"""The digest of an empty slot (a key whose digest is 0 is given 1: see `digest`)."""


def digest(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") or 1


def _touched(shape: int, dtype: str | type) -> np.ndarray:
    """An array whose pages are resident now, not when first written (np.zeros maps them lazily)."""
    out = np.empty(shape, dtype=dtype)
    out.fill(0)
    return out


class RecentKeys:
    """The last `capacity` keys `put`, oldest evicted first; `get` returns a key's value."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"RecentKeys: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._digests = _touched(capacity, np.uint64)
        self._values = _touched(capacity, np.int64)
        self._used = 0
        self._next = 0

    def __len__(self) -> int:
        return self._used

    def get(self, key: str) -> int | None:
        hits = np.flatnonzero(self._digests[: self._used] == np.uint64(digest(key)))
        return None if hits.size == 0 else int(self._values[hits[0]])

    def put(self, key: str, value: int) -> None:
        """Remember `key` (a key already held keeps its slot and first value)."""
        if self.get(key) is not None:
            return
        self._digests[self._next] = digest(key)
        self._values[self._next] = value
        self._next = (self._next + 1) % self.capacity
        self._used = min(self._used + 1, self.capacity)


class RecentIds:
    """The last `capacity` ids added, oldest evicted first, the ids kept (see the module docstring)."""

    def __init__(self, capacity: int, ids: Iterable[str] = (), width: int = 64) -> None:
        if capacity < 1:
            raise ValueError(f"RecentIds: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.width = width
        self._digests = _touched(capacity, np.uint64)
        self._ids = _touched(capacity, f"S{width}")
        self._long: dict[int, str] = {}
        """slot -> an id longer than `width` bytes held there."""
        self._count = 0
        self._next = 0
        for i in ids:
            self.add(i)

    def __len__(self) -> int:
        return self._count

    def __contains__(self, key: str) -> bool:
        return self._slot(key) is not None

    def _slot(self, key: str) -> int | None:
        hits = np.flatnonzero(self._digests == np.uint64(digest(key)))
        return None if hits.size == 0 else int(hits[0])

    def _id(self, slot: int) -> str:
        held = self._long.get(slot)
        return held if held is not None else bytes(self._ids[slot]).decode()

    def _clear(self, slot: int) -> None:
        self._digests[slot] = EMPTY
        self._ids[slot] = b""
        self._long.pop(slot, None)
        self._count -= 1

    def add(self, key: str) -> str | None:
        """Remember `key` as the newest (one already held moves to the newest place); returns the
        id evicted to make room, if any."""
        self.discard(key)
        slot = self._next
        evicted = None
        if self._digests[slot] != EMPTY:
            evicted = self._id(slot)
            self._clear(slot)
        raw = key.encode()
        self._digests[slot] = digest(key)
        if len(raw) > self.width or raw.endswith(b"\0"):  # numpy's S type would cut or strip it
            self._long[slot] = key
        else:
            self._ids[slot] = raw
        self._count += 1
        self._next = (slot + 1) % self.capacity
        return evicted

    def discard(self, key: str) -> None:
        slot = self._slot(key)
        if slot is not None:
            self._clear(slot)

    def ids(self) -> list[str]:
        """The ids held, oldest first."""
        order = [(s + self._next) % self.capacity for s in range(self.capacity)]
        return [self._id(s) for s in order if self._digests[s] != EMPTY]
