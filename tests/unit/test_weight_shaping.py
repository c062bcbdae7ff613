"""Smaller pushes' pure parts (docs/weight-pushes.md): the bf16 rounding the cast does, the held
copy's change detection, and the config keys' one-line refusals."""

from __future__ import annotations

import pytest
import torch

from stream_rl.config import load_config
from stream_rl.errors import ConfigError, WeightSyncError
from stream_rl.weights import TensorMeta, WeightSender
from stream_rl.weights.sender_choice import make_builtin_sender
from stream_rl.weights.shaping import HeldWeights, cast_to, moved, server_dtypes

pytestmark = pytest.mark.unit


def bf16_round_nearest_even(x: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16 written from the definition: keep the top 16 bits, rounding the 16
    dropped ones to nearest, ties to the even result; NaN stays NaN."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    lsb = (bits >> 16) & 1
    rounded = ((bits + 0x7FFF + lsb) >> 16) & 0xFFFF
    nan = torch.isnan(x)
    rounded = torch.where(nan, (bits >> 16) | 0x40, rounded)  # quiet NaN, as torch does
    return rounded.to(torch.int16).view(torch.bfloat16)


def test_the_cast_is_round_to_nearest_even_on_the_bit_pattern() -> None:
    gen = torch.Generator().manual_seed(0)
    randoms = torch.randn(4096, generator=gen) * torch.logspace(-30, 30, 4096)
    one = torch.tensor([1.0]).view(torch.int32)
    # exact ties around 1.0: 1 + half an ulp (to even: down), 1 + 3 half-ulps (to even: up)
    ties = torch.cat([one + 0x8000, one + 0x18000, one + 0x7FFF, one + 0x8001]).view(torch.float32)
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.4e38, 1e-45, -1e-45])
    x = torch.cat([randoms, ties, specials])
    ((_, cast),) = cast_to([("w", x)], {"w": "bfloat16"})
    want = bf16_round_nearest_even(x)
    assert torch.equal(cast.view(torch.int16), want.view(torch.int16))
    assert cast[4096:4100].tolist() == [1.0, 1.0 + 2**-6, 1.0, 1.0 + 2**-7]
    nan = cast_to([("w", torch.tensor([float("nan")]))], {"w": "bfloat16"})[0][1]
    assert torch.isnan(nan).all()


def test_cast_leaves_tensors_already_in_the_servers_dtype_uncopied() -> None:
    t = torch.ones(3)
    ((_, same),) = cast_to([("w", t)], {"w": "float32"})
    assert same.data_ptr() == t.data_ptr()


def test_servers_holding_different_dtypes_are_refused_in_one_line() -> None:
    a = {"w": TensorMeta("w", "bfloat16", (2,))}
    b = {"w": TensorMeta("w", "float16", (2,))}
    assert server_dtypes(["w", "x"], {"a": a}) == {"w": "bfloat16"}
    with pytest.raises(WeightSyncError, match="w is bfloat16 on a but float16 on b"):
        server_dtypes(["w"], {"a": a, "b": b})


def test_threshold_zero_sees_every_bit_and_nan_always_counts() -> None:
    zero = torch.tensor([0.0, 1.0])
    assert moved(torch.tensor([-0.0, 1.0]), zero, 0.0)  # equal as numbers, not as bytes
    assert not moved(zero.clone(), zero, 0.0)
    assert moved(torch.tensor([float("nan"), 1.0]), zero, 0.5)
    assert not moved(torch.tensor([0.25, 1.25]), zero, 0.25)
    assert moved(torch.tensor([0.25, 1.2501]), zero, 0.25)
    assert not moved(torch.zeros(0), torch.zeros(0), 0.1) and not moved(torch.zeros(0), torch.zeros(0), 0.0)


def test_held_weights_advance_only_what_moved_and_restart_on_a_new_layout() -> None:
    held = HeldWeights(0.1)
    a, b = torch.zeros(2), torch.ones(3)
    assert held.advance(1, [("a", a), ("b", b)]) == ["a", "b"]
    assert held.tensors["a"].data_ptr() != a.data_ptr()  # a copy, not the trainer's tensor
    a += 0.05
    b += 0.5
    assert held.advance(2, [("a", a), ("b", b)]) == ["b"]
    assert held.version == 2 and torch.equal(held.tensors["a"], torch.zeros(2))
    a += 0.06  # 0.11 from what the servers hold: now it goes
    assert held.advance(3, [("a", a), ("b", b)]) == ["a"]
    assert [n for n, _ in held.named(["b"])] == ["b"]
    assert held.advance(4, [("a", a.double())]) == ["a"]  # another layout: everything again


def test_push_options_are_validated() -> None:
    with pytest.raises(WeightSyncError, match="push_dtype must be one of trainer, server"):
        WeightSender([], master_port=0, push_dtype="bf16")
    with pytest.raises(WeightSyncError, match="delta_threshold must be >= 0"):
        WeightSender([], master_port=0, delta_threshold=-1.0)
    with pytest.raises(WeightSyncError, match="need weight transport gloo or nccl"):
        make_builtin_sender(
            [],
            transport="cuda_ipc",
            trainer_device="cuda",
            master_addr="127.0.0.1",
            master_port=0,
            timeout_s=1,
            push_dtype="server",
        )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["inference.dtype=bfloat16"],
            "inference.dtype bfloat16 differs from model.dtype float32: .*push_dtype: server",
        ),
        (["trainer.push_dtype=server", "inference.engine=vllm"], "apply to built-in servers only"),
        (
            [
                "trainer.push_delta_threshold=0",
                "inference.servers=[{url: 'http://h:1', engine: sglang}]",
                "inference.device=cuda",
                "trainer.device=cuda",
            ],
            "built-in",
        ),
        (
            ["inference.dtype=bfloat16", "inference.servers=[{url: 'http://h:1'}]"],
            "inference.dtype applies to",
        ),
        (
            [
                "trainer.push_dtype=server",
                "trainer.weight_transport=cuda_ipc",
                "trainer.device=cuda",
                "inference.device=cuda",
            ],
            "gloo or nccl",
        ),
        (["trainer.push_delta_threshold=-1"], "greater than or equal to 0"),
    ],
)
def test_config_refusals_are_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        load_config(None, overrides)
    assert "\n" not in str(caught.value)


def test_a_bf16_engine_for_an_fp32_trainer_is_launched_and_pushed_cast() -> None:
    from stream_rl.inference.launching import launch_for
    from stream_rl.train.push import make_sender

    config = load_config(
        None, ["inference.dtype=bfloat16", "trainer.push_dtype=server", "trainer.push_delta_threshold=0"]
    )
    cmd = launch_for(config, 0).cmd
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
    sender = make_sender(config)
    assert isinstance(sender, WeightSender)
    try:
        assert sender.push_dtype == "server" and sender._held is not None and sender._held.threshold == 0.0
    finally:
        sender.close()
