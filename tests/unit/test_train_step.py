"""The trainer's model step with a tiny model: direction of one step (each policy loss), zero
advantages, determinism, gradient averaging over the step's sequences, GSPO's sequences in the
packed rows, the new losses with KL, entropy and overlong filtering."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from fakes.training import make_batches, make_sample, make_tiny_model

from stream_rl.config import TrainerConfig
from stream_rl.train.rows import pack_forwards
from stream_rl.train.step import PolicyTrainer, configure_determinism, load_model

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def trainer(model_dir: Path, **overrides: object) -> PolicyTrainer:
    configure_determinism(True, seed=0, threads=1)
    cfg = TrainerConfig.model_validate({"lr": 1e-3, "grad_clip": 100.0, **overrides})
    return PolicyTrainer(load_model(model_dir, "float32", "cpu"), cfg, temperature=1.0)


def on_policy(t: PolicyTrainer, samples: list) -> list:  # type: ignore[type-arg]
    """Set behaviour logprobs to the model's own, so the importance weight is exactly 1."""
    lp = t.logprobs(samples).tolist()
    k = 0
    for s in samples:
        n = s.completion_len
        s.behaviour_logprobs = lp[k : k + n]
        k += n
    return samples


def per_sample_sum(t: PolicyTrainer, samples: list) -> list[float]:  # type: ignore[type-arg]
    lp = t.logprobs(samples)
    out, k = [], 0
    for s in samples:
        mask = torch.tensor(s.loss_mask)
        out.append(float(lp[k : k + s.completion_len][mask].sum()))
        k += s.completion_len
    return out


@pytest.mark.parametrize("kind", ["reinforce", "ppo", "gspo", "cispo"])
def test_one_step_raises_positive_and_lowers_negative(model_dir: Path, kind: str) -> None:
    t = trainer(model_dir, lr=1e-4, policy_loss=kind)
    rng = random.Random(3)
    samples = [make_sample(rng, key=f"g{i}", advantage=1.0 if i % 2 == 0 else -1.0) for i in range(6)]
    on_policy(t, samples)
    before = per_sample_sum(t, samples)
    weights = t.checksum()
    result = t.micro_batch(samples)
    assert result.stats.tokens == sum(sum(s.loss_mask) for s in samples)
    assert result.stats.metrics()["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert result.stats.sequences == len(samples)  # the trainer passes each token's sample
    assert result.stats.clamped == 0  # on-policy: nothing is clipped, whatever the loss
    outcome = t.optimizer_step(len(samples))
    assert outcome.grad_norm > 0 and outcome.lr == pytest.approx(1e-4)
    assert t.checksum() != weights
    after = per_sample_sum(t, samples)
    for s, b, a in zip(samples, before, after, strict=True):
        if s.advantages[0] > 0:
            assert a > b, (s.rollout_id, b, a)
        else:
            assert a < b, (s.rollout_id, b, a)


def test_zero_advantages_change_only_the_optimizer_state(model_dir: Path) -> None:
    t = trainer(model_dir)
    rng = random.Random(4)
    samples = on_policy(t, [make_sample(rng, key=f"g{i}", advantage=0.0) for i in range(4)])
    before = t.checksum()
    t.micro_batch(samples)
    t.optimizer_step(len(samples))
    assert t.checksum() == before
    state = t.optimizer.state_dict()["state"]
    assert state and all(float(s["step"]) == 1.0 for s in state.values())
    assert t.scheduler.last_epoch == 1


def test_step_without_trained_sequences_keeps_weights(model_dir: Path) -> None:
    t = trainer(model_dir)
    before = t.checksum()
    outcome = t.optimizer_step(0)
    assert outcome.grad_norm == 0.0
    assert t.checksum() == before


def test_same_batches_same_weights_bit_for_bit(model_dir: Path) -> None:
    batches = make_batches(4, 3, seed=5)

    def train(order: list[int]) -> str:
        t = trainer(model_dir)
        for step in range(2):
            for b in order[2 * step : 2 * step + 2]:
                t.micro_batch(batches[b].samples)
            t.optimizer_step(6)
        return t.checksum()

    first = train([0, 1, 2, 3])
    assert train([0, 1, 2, 3]) == first
    assert train([2, 1, 0, 3]) != first  # other step contents, other weights


def test_gradients_are_averaged_over_the_steps_sequences(model_dir: Path) -> None:
    """Two micro-batches of one step give the gradient of one micro-batch holding both."""
    rng = random.Random(9)
    samples = [make_sample(rng, key=f"g{i}") for i in range(4)]
    split = trainer(model_dir)
    split.micro_batch(samples[:2])
    split.micro_batch(samples[2:])
    joint = trainer(model_dir)
    joint.micro_batch(samples)
    for a, b in zip(split.params, joint.params, strict=True):
        assert a.grad is not None and b.grad is not None
        assert torch.allclose(a.grad / 4, b.grad / 4, atol=1e-6)
    # and `optimizer_step(n)` divides by n before clipping: the reported norm scales with 1/n
    norm_sum = float(torch.norm(torch.stack([p.grad.norm() for p in joint.params if p.grad is not None])))
    assert joint.optimizer_step(4).grad_norm == pytest.approx(norm_sum / 4, rel=1e-5)


def test_gspo_clips_whole_samples_of_a_packed_row(model_dir: Path) -> None:
    """One sample of a packed row is made off-policy (every token's ratio e^0.01, so its sequence
    ratio is above GSPO's 1 + 4e-4 with a positive advantage): that whole sample, and only it, is
    clipped, so the gradient is that of the others alone."""
    rng = random.Random(11)
    samples = [make_sample(rng, key=f"g{i}", advantage=1.0 if i % 2 == 0 else -0.5) for i in range(5)]
    ((packed, _),) = pack_forwards(samples, TrainerConfig().pack_row_tokens)
    assert packed.input_ids.shape[0] == 1  # all five in one row
    t = trainer(model_dir, policy_loss="gspo")
    on_policy(t, samples)
    samples[0].behaviour_logprobs = [x - 0.01 for x in samples[0].behaviour_logprobs]
    result = t.micro_batch(samples)
    assert result.stats.clamped == sum(samples[0].loss_mask)
    assert result.stats.metrics()["seq_ratio_mean"] == pytest.approx((math.exp(0.01) + 4) / 5, abs=1e-5)
    others = trainer(model_dir, policy_loss="gspo")
    others.micro_batch(samples[1:])
    for a, b in zip(t.params, others.params, strict=True):
        assert a.grad is not None and b.grad is not None
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-7)
    assert any(float(p.grad.abs().max()) > 0 for p in others.params if p.grad is not None)


@pytest.mark.parametrize("kind", ["gspo", "cispo"])
def test_new_losses_train_with_kl_entropy_and_overlong_filtering(model_dir: Path, kind: str) -> None:
    configure_determinism(True, seed=0, threads=1)
    cfg = TrainerConfig.model_validate(
        {"policy_loss": kind, "kl_coef": 0.1, "entropy_coef": 0.01, "overlong_filtering": True}
    )
    ref = load_model(model_dir, "float32", "cpu")
    t = PolicyTrainer(load_model(model_dir, "float32", "cpu"), cfg, temperature=1.0, ref_model=ref)
    rng = random.Random(12)
    samples = [make_sample(rng, key=f"g{i}", finish_reason="length" if i == 0 else "stop") for i in range(4)]
    before = t.checksum()
    result = t.micro_batch(samples)
    assert result.finite and math.isfinite(result.loss)
    assert result.stats.filtered_tokens == sum(samples[0].loss_mask)
    metrics = result.stats.metrics()
    assert metrics["kl_ref"] == pytest.approx(0.0, abs=1e-9)  # the reference is the initial model
    assert metrics["entropy"] > 0
    assert t.optimizer_step(len(samples)).grad_norm > 0
    assert t.checksum() != before
