"""`RecentKeys`: the last `capacity` keys a stage took, each with an int, in memory fixed at start.

A duplicate check over a long run needs a window of recent keys. Held as Python objects (an
`OrderedDict` of tuples) such a window costs ~280 bytes a key and grows until it is full, which
at the actor's rate (a key per problem) took longer than a soak: its memory crept for half an
hour. Here the window is two numpy arrays allocated at construction (16 bytes a slot: a 64-bit
BLAKE2b digest of the key and its value), written as a ring, so the process's memory does not
move after start-up. A lookup compares the digest with every slot (vectorised: ~10 us for 20,000
slots), which is cheap at the rates keys arrive (problems, not tokens).

Two distinct keys share a digest with probability ~n^2 / 2^65 for n keys in the window (1e-11
for 20,000): such a key would be taken for a duplicate of the other.
"""

from __future__ import annotations

import hashlib

import numpy as np


def digest(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


class RecentKeys:
    """The last `capacity` keys `put`, oldest evicted first; `get` returns a key's value."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"RecentKeys: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._digests = np.zeros(capacity, dtype=np.uint64)
        self._values = np.zeros(capacity, dtype=np.int64)
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
