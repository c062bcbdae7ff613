"""Bucket planning, the byte layout of a bucket, and the weights checksum."""

from __future__ import annotations

import pytest
import torch

from stream_rl.errors import WeightSyncError
from stream_rl.weights import TensorMeta, pack_bucket, plan_buckets, unpack_bucket, weights_checksum

pytestmark = pytest.mark.unit


def meta(name: str, dtype: str, *shape: int) -> TensorMeta:
    return TensorMeta(name, dtype, tuple(shape))


def names(buckets: list[list[TensorMeta]]) -> list[list[str]]:
    return [[m.name for m in bucket] for bucket in buckets]


def test_meta_sizes_and_dict_round_trip() -> None:
    m = meta("w", "bfloat16", 3, 5)
    assert m.nbytes == 30
    assert meta("s", "float32").nbytes == 4  # a scalar
    assert TensorMeta.from_dict(m.to_dict()) == m
    assert m.to_dict() == {"name": "w", "dtype": "bfloat16", "shape": [3, 5]}
    assert TensorMeta.from_tensor("x", torch.zeros(2, 3, dtype=torch.float16)) == meta("x", "float16", 2, 3)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"name": "w", "dtype": "int8", "shape": [2]}, "dtype 'int8'"),
        ({"name": "w", "dtype": "float32"}, "lacks"),
        ({"name": "w", "dtype": "float32", "shape": [2.5]}, "list of integers"),
        ({"name": "w", "dtype": "float32", "shape": [-1]}, "negative"),
    ],
)
def test_bad_meta_is_rejected(data: dict[str, object], message: str) -> None:
    with pytest.raises(WeightSyncError, match=message):
        TensorMeta.from_dict(data)


def test_unsupported_tensor_dtype_is_rejected() -> None:
    with pytest.raises(WeightSyncError, match="int64"):
        TensorMeta.from_tensor("steps", torch.zeros(2, dtype=torch.int64))


def test_plan_keeps_order_and_fills_buckets_up_to_the_limit() -> None:
    metas = [
        meta("a", "float32", 4),
        meta("b", "float32", 4),
        meta("c", "float32", 4),
        meta("d", "float16", 8),
    ]
    # 16 + 16 = 32 fits; c would make 48
    assert names(plan_buckets(metas, 32)) == [["a", "b"], ["c", "d"]]
    assert names(plan_buckets(metas, 1 << 20)) == [["a", "b", "c", "d"]]
    flat = [m for bucket in plan_buckets(metas, 20) for m in bucket]
    assert flat == metas


def test_oversize_tensor_travels_alone() -> None:
    metas = [
        meta("a", "float32", 2),
        meta("huge", "float32", 100),
        meta("b", "float32", 2),
        meta("c", "float32", 2),
    ]
    assert names(plan_buckets(metas, 16)) == [["a"], ["huge"], ["b", "c"]]
    # every tensor bigger than the bucket: one collective per tensor
    assert names(plan_buckets(metas, 1)) == [["a"], ["huge"], ["b"], ["c"]]


def test_plan_rejects_non_positive_bucket_size() -> None:
    with pytest.raises(WeightSyncError, match="at least 1"):
        plan_buckets([meta("a", "float32", 1)], 0)


def test_pack_layout_is_raw_bytes_back_to_back() -> None:
    a = torch.tensor([1.0, -2.0], dtype=torch.float32)
    b = torch.tensor([0.5, 3.0, -1.0], dtype=torch.bfloat16)
    packed = pack_bucket([a, b])
    assert packed.dtype == torch.uint8 and packed.dim() == 1 and packed.numel() == 8 + 6
    expected = a.numpy().tobytes() + b.view(torch.int16).numpy().tobytes()
    assert packed.numpy().tobytes() == expected


def test_pack_of_one_contiguous_tensor_is_a_view_and_out_buffer_is_reused() -> None:
    t = torch.arange(6, dtype=torch.float32)
    view = pack_bucket([t])
    assert view.data_ptr() == t.data_ptr()
    out = torch.zeros(64, dtype=torch.uint8)
    packed = pack_bucket([t, t.flip(0)], out=out)
    assert packed.data_ptr() == out.data_ptr() and packed.numel() == 48


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pack_unpack_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(3, generator=gen).to(dtype),  # odd sizes misalign what follows
        torch.randn(5, 7, generator=gen).to(dtype).T,  # non-contiguous source
        torch.tensor(float("nan")).to(dtype),  # a scalar, and a NaN payload
        torch.randn(4, 1, generator=gen).to(torch.float32),  # a float32 after odd half-precision
    ]
    metas = [TensorMeta.from_tensor(f"t{i}", t) for i, t in enumerate(tensors)]
    out = unpack_bucket(pack_bucket(tensors), metas)
    assert [m for m, _ in out] == metas
    for (_, got), want in zip(out, tensors, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8))


def test_unpack_rejects_a_bucket_of_the_wrong_size() -> None:
    with pytest.raises(WeightSyncError, match="expected 8"):
        unpack_bucket(torch.zeros(7, dtype=torch.uint8), [meta("a", "float32", 2)])


def test_checksum_depends_on_bytes_names_shapes_and_order() -> None:
    a = torch.arange(6, dtype=torch.float32)
    b = torch.ones(2, dtype=torch.bfloat16)
    base = weights_checksum([("a", a), ("b", b)])
    assert base == weights_checksum([("a", a.clone()), ("b", b.clone())])
    assert len(base) == 64
    changed = a.clone()
    changed[3] = torch.nextafter(changed[3], torch.tensor(10.0))  # one ulp
    variants = [
        [("a", changed), ("b", b)],
        [("A", a), ("b", b)],
        [("a", a.view(2, 3)), ("b", b)],
        [("b", b), ("a", a)],
        [("a", a), ("b", b.to(torch.float16))],
    ]
    assert all(weights_checksum(v) != base for v in variants)
