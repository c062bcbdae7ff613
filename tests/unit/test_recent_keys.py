"""`RecentKeys`: the actor's duplicate window in memory fixed at construction."""

from __future__ import annotations

import tracemalloc

import pytest

from stream_rl.stages.recent_keys import RecentKeys

pytestmark = pytest.mark.unit


def test_keys_are_found_until_evicted_oldest_first() -> None:
    w = RecentKeys(3)
    for i, k in enumerate("abc"):
        w.put(k, i)
    assert [w.get(k) for k in "abcd"] == [0, 1, 2, None]
    w.put("a", 99)  # held: keeps its slot and first value
    assert w.get("a") == 0 and len(w) == 3
    w.put("d", 3)  # evicts the oldest, a
    assert [w.get(k) for k in "abcd"] == [None, 1, 2, 3]
    w.put("e", 4)
    assert w.get("b") is None and w.get("e") == 4
    with pytest.raises(ValueError, match="capacity"):
        RecentKeys(0)


def test_memory_does_not_move_after_construction() -> None:
    """The old window (an OrderedDict of tuples) grew ~280 bytes a key until full: 5.4 MiB over the
    half hour the actor took to fill it. This one holds 20,000 keys in the arrays it starts with."""
    tracemalloc.start()
    try:
        w = RecentKeys(20_000)
        before, _ = tracemalloc.get_traced_memory()
        for i in range(50_000):
            w.put(f"arithmetic-{i}:{i % 7}", i)
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(w) == 20_000 and w.get("arithmetic-49999:5") == 49_999 and w.get("arithmetic-0:0") is None
    assert after - before < 4096, f"grew {after - before} bytes"
