"""`stream_rl.common.windows`: duplicate windows in memory fixed at construction."""

from __future__ import annotations

import tracemalloc

import pytest

from stream_rl.common.windows import RecentIds, RecentKeys

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
    half hour the actor took to fill it. This one holds its keys in the arrays it starts with (2,000
    here, put 2.5 times over: the old one would have grown ~550 KB; the actor's 20,000 only make
    each put's scan longer)."""
    tracemalloc.start()
    try:
        w = RecentKeys(2_000)
        before, _ = tracemalloc.get_traced_memory()
        for i in range(5_000):
            w.put(f"arithmetic-{i}:{i % 7}", i)
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(w) == 2_000 and w.get("arithmetic-4999:1") == 4_999 and w.get("arithmetic-0:0") is None
    assert after - before < 4096, f"grew {after - before} bytes"


def test_ids_come_back_oldest_first_with_what_each_add_evicted() -> None:
    w = RecentIds(3, width=8)
    assert [w.add(k) for k in ("a", "b", "c")] == [None, None, None]
    assert w.add("a") is None  # held: moves to the newest place, nothing evicted
    assert w.ids() == ["b", "c", "a"]
    long = "a-problem-id-longer-than-eight-bytes.e3"
    assert w.add(long) == "b" and long in w and "b" not in w
    assert w.ids() == ["c", "a", long] and len(w) == 3
    w.discard("c")
    assert w.ids() == ["a", long] and len(w) == 2 and "c" not in w
    assert w.add("\u00e9t\u00e9") is None  # a hole was free: nothing evicted
    assert RecentIds(3, w.ids(), width=8).ids() == w.ids()  # rebuilt from a checkpoint's list
    with pytest.raises(ValueError, match="capacity"):
        RecentIds(0)


def test_ids_window_memory_does_not_move_after_construction() -> None:
    """The closed-group and trained-id windows were OrderedDicts of strings (~150 bytes an id,
    growing until full); these hold ids in the arrays they start with, long ones aside (2,000 here,
    added 2.5 times over, as above)."""
    tracemalloc.start()
    try:
        w = RecentIds(2_000)
        before, _ = tracemalloc.get_traced_memory()
        first_evicted, n_evicted = None, 0
        for i in range(5_000):
            out = w.add(f"arithmetic-{i}+3.e{i % 5}.s1")
            if out is not None:
                first_evicted = first_evicted or (i, out)
                n_evicted += 1
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert first_evicted == (2_000, "arithmetic-0+3.e0.s1") and n_evicted == 3_000
    assert len(w) == 2_000 and w.ids()[-1] == "arithmetic-4999+3.e4.s1"
    assert after - before < 4096, f"grew {after - before} bytes"
