"""Long samples in the trainer: one longer than a packed row (`pack_row_tokens`) and one longer
than the preprocessor's micro-batch budget are each trained exactly once, and the loss and the
gradients equal a float64 reference computed sample by sample without packing."""

from __future__ import annotations

import copy
import dataclasses
import math
import random
from pathlib import Path

import pytest
import torch
from fakes.training import make_sample, make_tiny_model

from stream_rl.config import TrainerConfig
from stream_rl.contracts import TrainingSample
from stream_rl.kafka.serde import default_serde
from stream_rl.stages.micro_batches import pack
from stream_rl.train.rows import pack_forwards
from stream_rl.train.step import PolicyTrainer, configure_determinism, load_model
from stream_rl.train.step_runner import StepRunner

pytestmark = pytest.mark.unit

ROW = 64
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def samples() -> list[TrainingSample]:
    """Six short samples and two long ones: 308 and 140 tokens, rows of 64."""
    rng = random.Random(21)
    out = [make_sample(rng, key=f"s{i}") for i in range(3)]
    out.append(make_sample(rng, key="long", prompt_len=(8, 8), completion_len=(300, 300)))
    out += [make_sample(rng, key=f"t{i}") for i in range(3)]
    out.append(make_sample(rng, key="mid", prompt_len=(20, 20), completion_len=(120, 120)))
    return out


def trainer(model_dir: Path) -> PolicyTrainer:
    configure_determinism(True, seed=0, threads=1)
    cfg = TrainerConfig.model_validate({"pack_row_tokens": ROW, "grad_clip": 1e9, "eps_high": 0.2})
    return PolicyTrainer(load_model(model_dir, "float32", "cpu"), cfg, temperature=TEMPERATURE)


def reference(model_dir: Path, batch: list[TrainingSample], eps_high: float = 0.2):  # type: ignore[no-untyped-def]
    """(summed loss, gradients by name) in float64, each sample alone and unpacked: the
    truncated-IS REINFORCE loss `-A * stopgrad(min(rho, 1 + eps)) * logp` over trainable tokens."""
    model = copy.deepcopy(load_model(model_dir, "float32", "cpu")).double()
    total = torch.zeros((), dtype=torch.float64)
    for s in batch:
        logits = model(torch.tensor([s.input_ids])).logits[0, s.prompt_len - 1 : -1]
        logp_all = torch.log_softmax(logits / TEMPERATURE, -1)
        labels = torch.tensor(s.input_ids[s.prompt_len :])
        logp = logp_all.gather(-1, labels[:, None])[:, 0]
        behaviour = torch.tensor(s.behaviour_logprobs, dtype=torch.float64)
        weight = torch.clamp(torch.exp(logp - behaviour), max=1 + eps_high).detach()
        adv = torch.tensor(s.advantages, dtype=torch.float64)
        mask = torch.tensor(s.loss_mask, dtype=torch.float64)
        total = total - (adv * weight * logp * mask).sum()
    total.backward()
    return float(total), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_sample_longer_than_a_row_gets_its_own_pass(model_dir: Path) -> None:
    batch = samples()
    passes = pack_forwards(batch, ROW)
    # the two long samples alone (unpadded), then the six short ones in 64-token rows
    assert [part for _, part in passes] == [[3], [7], [0, 1, 2, 4, 5, 6]]
    assert passes[0][0].input_ids.shape == (1, 308) and passes[0][0].fill == 1.0
    assert passes[1][0].input_ids.shape == (1, 140)
    assert max(p.input_ids.shape[1] for p, _ in passes[2:]) <= 2 * ROW
    assert sorted(i for _, part in passes for i in part) == list(range(len(batch)))  # each once

    t = trainer(model_dir)
    result = t.micro_batch(batch)
    ref_loss, ref_grads = reference(model_dir, batch)
    assert result.loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-4)
    assert result.real_tokens == sum(len(s.input_ids) for s in batch)
    assert result.stats.tokens == sum(sum(s.loss_mask) for s in batch)
    grads = {n: p.grad for n, p in t.model.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert torch.allclose(grad.double(), ref_grads[name], rtol=1e-3, atol=1e-5), name
    # logprobs come back in sample order whatever the passes' order
    lp = t.logprobs(batch)
    assert lp.shape == (sum(s.completion_len for s in batch),)
    k = sum(s.completion_len for s in batch[:3])
    alone = t.logprobs([batch[3]])
    assert torch.allclose(lp[k : k + 300], alone, atol=1e-5)


def test_a_sample_longer_than_the_micro_batch_budget_is_trained_once(model_dir: Path) -> None:
    """The preprocessor sends it alone (over budget, never dropped); the trainer's step trains
    every sample of the stream once: its summed loss is the float64 reference's."""
    batch = samples()
    serde = default_serde()
    packed = pack(
        batch,
        max_tokens=128,
        max_bytes=1_000_000,
        num_filtered=0,
        filtered_keys=[],
        encode=serde.encode,
        run_id="r",
        producer_id="p",
    )
    sizes = [[s.rollout_id for s in tb.samples] for tb, _ in packed]
    assert ["long.s0"] in sizes and ["mid.s0"] in sizes  # over 128 tokens: alone
    assert sorted(r for part in sizes for r in part) == sorted(s.rollout_id for s in batch)
    t = trainer(model_dir)
    runner = StepRunner(t, flush_tokens=ROW)
    for tb, data in packed:
        runner.add(serde.decode(data, type(tb)), version=0)
    summary = runner.finish()
    ref_loss, _ = reference(model_dir, batch)
    assert summary.acc.samples_trained == len(batch)
    assert summary.acc.tokens == sum(len(s.input_ids) for s in batch)
    assert summary.acc.loss_sum == pytest.approx(ref_loss, rel=1e-5, abs=1e-4)
    assert summary.metrics["tokens"] == sum(sum(s.loss_mask) for s in batch)


def test_a_non_finite_pass_is_dropped_and_the_others_train(model_dir: Path) -> None:
    """The long sample's pass has a NaN loss (NaN advantages): that pass alone is left out of the
    gradients and the result (`finite` False), the micro-batch's other passes train as usual."""
    batch = samples()
    poisoned = [
        dataclasses.replace(s, advantages=[math.nan] * len(s.advantages)) if s.rollout_id == "long.s0" else s
        for s in batch
    ]
    t = trainer(model_dir)
    result = t.micro_batch(poisoned)
    rest = [s for s in batch if s.rollout_id != "long.s0"]
    ref_loss, ref_grads = reference(model_dir, rest)
    assert not result.finite
    assert result.loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-4)
    assert result.real_tokens == sum(len(s.input_ids) for s in rest)
    for name, p in t.model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert torch.allclose(p.grad.double(), ref_grads[name], rtol=1e-3, atol=1e-5), name
