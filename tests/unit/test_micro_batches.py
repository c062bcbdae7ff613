"""Packing: in arrival order under a token budget, byte limits, the filtered count."""

from __future__ import annotations

from dataclasses import replace

import pytest
from fakes.records import make_scored, make_training_sample

from stream_rl.contracts import TrainingBatch
from stream_rl.kafka.serde import default_serde
from stream_rl.stages.micro_batches import batch_id, next_fit, pack

pytestmark = pytest.mark.unit


def test_next_fit_keeps_arrival_order() -> None:
    sizes = [5, 9, 3, 7, 2, 12, 1]
    bins = next_fit(sizes, 10)
    assert [i for b in bins for i in b] == list(range(7))  # in order, each once
    assert all(sum(sizes[i] for i in b) <= 10 for b in bins if len(b) > 1)
    # 5 | 9 | 3+7 | 2 | 12 (over budget: alone) | 1
    assert bins == [[0], [1], [2, 3], [4], [5], [6]]


def test_pack_never_puts_a_sample_behind_a_younger_one() -> None:
    """The trainer steps every S samples of the stream: a sample packed behind later arrivals can
    fall into the next step (a lag over the bound). Lengths that first-fit decreasing reorders."""
    ss = [
        make_training_sample(make_scored(i, 0, completion_len=2 + (i * 7) % 5, prompt_len=4))
        for i in range(40)
    ]
    out = pack(
        ss,
        max_tokens=30,
        max_bytes=1_000_000,
        num_filtered=0,
        max_samples=8,
        filtered_keys=[],
        encode=default_serde().encode,
        run_id="r",
        producer_id="p",
    )
    assert [s.rollout_id for b, _ in out for s in b.samples] == [s.rollout_id for s in ss]


def samples(n: int, length: int = 8):  # type: ignore[no-untyped-def]
    return [make_training_sample(make_scored(i, 0, completion_len=length, prompt_len=4)) for i in range(n)]


def test_pack_respects_the_token_budget_and_carries_the_filtered_count_once() -> None:
    serde = default_serde()
    ss = samples(7)  # 12 tokens each
    out = pack(
        ss,
        max_tokens=40,
        max_bytes=1_000_000,
        num_filtered=8,
        filtered_keys=["g1", "g2"],
        encode=serde.encode,
        run_id="r",
        producer_id="p",
    )
    batches = [b for b, _ in out]
    assert [b.num_samples for b in batches] == [3, 3, 1]
    assert all(b.num_tokens <= 40 for b in batches)
    assert [b.num_filtered for b in batches] == [8, 0, 0]
    assert sorted(s.rollout_id for b in batches for s in b.samples) == sorted(s.rollout_id for s in ss)
    for b, data in out:
        assert serde.decode(data, TrainingBatch) == b
    again = pack(
        ss,
        max_tokens=40,
        max_bytes=1_000_000,
        num_filtered=8,
        filtered_keys=["g1", "g2"],
        encode=serde.encode,
        run_id="r",
        producer_id="p",
    )
    assert [b.batch_id for b, _ in again] == [b.batch_id for b in batches]  # deterministic ids


def test_only_filtered_samples_make_an_empty_batch() -> None:
    serde = default_serde()
    [(b, data)] = pack(
        [],
        max_tokens=40,
        max_bytes=10_000,
        num_filtered=4,
        filtered_keys=["g"],
        encode=serde.encode,
        run_id="r",
        producer_id="p",
    )
    assert b.samples == [] and b.num_filtered == 4 and b.batch_id == batch_id(["filtered", "g"])
    assert serde.decode(data, TrainingBatch).num_filtered == 4


def test_batches_are_split_to_stay_under_the_byte_limit() -> None:
    serde = default_serde()
    ss = samples(8, length=400)
    one = len(serde.encode(TrainingBatch("x", "r", ss[:1], "p")))
    out = pack(
        ss,
        max_tokens=100_000,
        max_bytes=3 * one,
        num_filtered=0,
        filtered_keys=[],
        encode=serde.encode,
        run_id="r",
        producer_id="p",
    )
    assert len(out) > 1 and all(len(data) <= 3 * one for _, data in out)
    assert sum(b.num_samples for b, _ in out) == 8
    # A sample larger than the limit travels alone rather than being lost.
    big = [replace(ss[0], rollout_id="big")]
    [(b, data)] = pack(
        big,
        max_tokens=10,
        max_bytes=100,
        num_filtered=0,
        filtered_keys=[],
        encode=serde.encode,
        run_id="r",
        producer_id="p",
    )
    assert b.num_samples == 1 and len(data) > 100


def test_next_fit_caps_items_per_bin() -> None:
    bins = next_fit([10] * 20, budget=1000, max_items=8)
    assert [len(b) for b in bins] == [8, 8, 4]
    assert [i for b in bins for i in b] == list(range(20))
