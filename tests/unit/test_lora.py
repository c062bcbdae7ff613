"""`trainer.lora`: the config's checks, the merge against a float64 reference written from the
formula, and the wire names' pairing (`stream_rl.weights.lora`)."""

from __future__ import annotations

import pytest
import torch

from stream_rl.config import load_config
from stream_rl.errors import ConfigError, WeightSyncError
from stream_rl.weights.buckets import TensorMeta
from stream_rl.weights.lora import LoraTensors, MergedWeights, adapters_of, merge, pair_metas

pytestmark = pytest.mark.unit


def test_lora_is_off_by_default_and_set_from_the_command_line() -> None:
    assert load_config(None).trainer.lora is None
    cfg = load_config(None, ["trainer.lora.rank=4", "trainer.lora.target_modules=[q_proj,v_proj]"])
    assert cfg.trainer.lora is not None
    assert (cfg.trainer.lora.rank, cfg.trainer.lora.alpha, cfg.trainer.lora.dropout) == (4, 16.0, 0.0)
    assert cfg.trainer.lora.target_modules == ["q_proj", "v_proj"]


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["trainer.lora.rank=0"], "trainer.lora.rank"),
        (["trainer.lora.alpha=0"], "trainer.lora.alpha"),
        (["trainer.lora.dropout=1.0"], "trainer.lora.dropout"),
        (["trainer.lora.target_modules=[]"], "trainer.lora.target_modules"),
        (["trainer.lora.ranks=4"], "ranks"),
        (["trainer.lora.rank=4", "trainer.backend=deepspeed"], "only trainer.backend: torch"),
        (["trainer.lora.rank=4", "trainer.backend=fsdp2"], "only trainer.backend: torch"),
        (["trainer.lora.rank=4", "trainer.push_delta_threshold=0"], "pushes only the adapters"),
        (["trainer.lora.rank=4", "trainer.push_dtype=server"], "pushes only the adapters"),
    ],
)
def test_bad_lora_settings_are_one_line_errors(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    message = str(err.value)
    assert needle in message
    assert "Traceback" not in message


def reference_merge(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W0 + scale * sum_k outer(B[:, k], A[k, :]), one rank-one term at a time, in float64."""
    out = base.to(torch.float64).clone()
    delta = torch.zeros_like(out)
    for k in range(a.shape[0]):
        delta += torch.outer(b[:, k].to(torch.float64), a[k, :].to(torch.float64))
    return out + scale * delta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_is_the_float64_formula_rounded_once(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(24, 16, generator=gen).to(dtype)
    a = torch.randn(4, 16, generator=gen)
    b = torch.randn(24, 4, generator=gen)
    merged = merge(base, a, b, 0.5)
    exact = reference_merge(base, a, b, 0.5)
    assert merged.dtype == dtype and merged.shape == base.shape
    # Rounded once from the float64 value: within half an ulp of the target dtype, and equal to it
    # where float64 has no sums of rank-one terms to round (a B of zeros: the base exactly).
    ulp = torch.finfo(dtype).eps * exact.abs().clamp_min(torch.finfo(dtype).tiny)
    assert torch.all((merged.to(torch.float64) - exact).abs() <= ulp)
    assert torch.equal(merged, exact.to(dtype))
    assert torch.equal(merge(base, a, torch.zeros_like(b), 2.0), base)


def meta(name: str, *shape: int) -> TensorMeta:
    return TensorMeta(name, "float32", tuple(shape))


WEIGHTS = {"q.weight": meta("q.weight", 24, 16), "q.bias": meta("q.bias", 24)}


def test_pairs_are_matched_to_their_weights() -> None:
    pairs = pair_metas([meta("q.weight.lora_A", 4, 16), meta("q.weight.lora_B", 24, 4)], WEIGHTS)
    assert [(p.name, p.a.shape, p.b.shape) for p in pairs] == [("q.weight", (4, 16), (24, 4))]


@pytest.mark.parametrize(
    ("metas", "needle"),
    [
        ([meta("q.weight.lora_A", 4, 16)], "q.weight: .lora_B missing"),
        ([meta("q.weight", 24, 16)], "not a LoRA tensor"),
        ([meta("k.weight.lora_A", 4, 16), meta("k.weight.lora_B", 24, 4)], "k.weight: no such weight"),
        ([meta("q.bias.lora_A", 4, 1), meta("q.bias.lora_B", 24, 4)], "is not a matrix"),
        ([meta("q.weight.lora_A", 4, 15), meta("q.weight.lora_B", 24, 4)], "do not give float32[24, 16]"),
        ([meta("q.weight.lora_A", 4, 16), meta("q.weight.lora_B", 24, 3)], "do not give"),
    ],
)
def test_pairs_that_cannot_merge_are_refused_by_name(metas: list[TensorMeta], needle: str) -> None:
    with pytest.raises(WeightSyncError, match="LoRA update does not match") as err:
        pair_metas(metas, WEIGHTS)
    assert needle in str(err.value)


def test_merged_weights_are_a_plain_list_with_the_adapters_attached() -> None:
    a, b = torch.ones(2, 3), torch.zeros(4, 2)
    lora = LoraTensors(scale=2.0, pairs=[("w", a, b)], base_checksum="c")
    merged = MergedWeights([("w", torch.zeros(4, 3))], lora)
    assert [n for n, _ in merged] == ["w"] and adapters_of(merged) is lora
    assert adapters_of([("w", torch.zeros(4, 3))]) is None
    assert [n for n, _ in lora.named()] == ["w.lora_A", "w.lora_B"] and lora.nbytes == (6 + 8) * 4
