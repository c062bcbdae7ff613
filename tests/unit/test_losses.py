"""The policy loss, its options and statistics against float64 references written as scalar loops."""

import math
import pickle

import pytest
import torch

from stream_rl.rl.logprobs import token_entropy, token_logprobs
from stream_rl.rl.losses import policy_loss
from stream_rl.rl.schedule import lr_factor, make_lr_lambda
from stream_rl.rl.stats import TokenStats, token_stats

pytestmark = pytest.mark.unit

TOL = 1e-6
torch.set_num_threads(1)

# One toy micro-batch, flat layout: 2 sequences of 4 tokens (first token of each is prompt).
LOGP = [-9.0, -1.0, -0.5, -2.0, -9.0, -0.3, -1.5, -0.05]
BEHAV = [-9.0, -1.1, -0.45, -2.3, -9.0, -0.2, -1.52, -0.04]
ADV = [0.0, 2.0, 2.0, 2.0, 0.0, -1.5, -1.5, -1.5]
MASK = [False, True, True, True, False, True, True, True]
REF = [-9.0, -1.2, -0.1, -8.0, -9.0, -0.3, -1.0, -0.5]
ENT = [0.0, 0.7, 0.2, 1.1, 0.0, 0.9, 0.4, 0.05]
TRUNC = [False, False, False, False, True, True, True, True]
N_SEQ = 4  # sequences in the optimizer step (more than in this micro-batch)


def t(values, requires_grad=False):
    return torch.tensor(values, dtype=torch.float64, requires_grad=requires_grad)


def run(**kwargs):
    logp = t(LOGP, requires_grad=True)
    entropy = kwargs.pop("entropy", None)
    ent = t(entropy, requires_grad=True) if entropy is not None else None
    out = policy_loss(logp, t(BEHAV), t(ADV), torch.tensor(MASK), num_sequences=N_SEQ, entropy=ent, **kwargs)
    out.loss.backward()
    ent_grad = ent.grad.tolist() if ent is not None and ent.grad is not None else None
    return out, logp.grad.tolist(), ent_grad


def reference(kind="reinforce", eps_low=0.02, eps_high=0.02, kl_coef=0.0, entropy_coef=0.0, overlong=False):
    """Loss and d loss / d logp, token by token, in float64."""
    total, grads = 0.0, []
    for i in range(len(LOGP)):
        keep = MASK[i] and not (overlong and TRUNC[i])
        if not keep:
            grads.append(0.0)
            continue
        lp, a = LOGP[i], ADV[i]
        rho = math.exp(lp - BEHAV[i])
        if kind == "reinforce":
            w = min(rho, 1 + eps_high)
            obj, dobj = a * w * lp, a * w
        else:
            clipped = min(max(rho, 1 - eps_low), 1 + eps_high)
            if rho * a <= clipped * a:
                obj, dobj = rho * a, rho * a
            else:
                obj, dobj = clipped * a, (rho * a if clipped == rho else 0.0)
        if kl_coef:
            d = max(-5.0, min(5.0, REF[i] - lp))
            obj -= kl_coef * (math.exp(d) - d - 1)
            dobj -= kl_coef * (-(math.exp(d) - 1) if abs(REF[i] - lp) < 5 else 0.0)
        if entropy_coef:
            obj += entropy_coef * ENT[i]
        total += obj
        grads.append(-dobj / N_SEQ)
    return -total / N_SEQ, grads


def assert_close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert abs(g - w) <= TOL, (got, want)


def test_reinforce_single_token_by_hand():
    # rho = e^0.1 = 1.105 > 1.02 -> weight 1.02; objective 2 * 1.02 * (-1) = -2.04; / 2 sequences
    logp = torch.tensor([-1.0], dtype=torch.float64, requires_grad=True)
    out = policy_loss(logp, t([-1.1]), t([2.0]), torch.tensor([True]), num_sequences=2)
    assert abs(out.loss.item() - 1.02) <= TOL
    out.loss.backward()
    assert abs(logp.grad.item() - (-2.0 * 1.02 / 2)) <= TOL  # stop-gradient through the weight
    assert out.stats.clamped == 1


def test_reinforce_default_matches_reference():
    out, grad, _ = run()
    want_loss, want_grad = reference()
    assert abs(out.loss.item() - want_loss) <= TOL
    assert_close(grad, want_grad)


def test_reinforce_truncation_has_no_lower_clamp():
    # rho = e^-2 = 0.135: far below 1 - eps, the weight stays rho (truncated IS, not PPO)
    logp = torch.tensor([-3.0], dtype=torch.float64, requires_grad=True)
    out = policy_loss(logp, t([-1.0]), t([1.0]), torch.tensor([True]), num_sequences=1, eps_high=0.5)
    assert abs(out.loss.item() - (-(math.exp(-2.0) * -3.0))) <= TOL


@pytest.mark.parametrize("eps_low,eps_high", [(0.02, 0.02), (0.2, 0.28), (0.05, 0.5)])
def test_ppo_matches_reference(eps_low, eps_high):
    out, grad, _ = run(policy_loss="ppo", eps_low=eps_low, eps_high=eps_high)
    want_loss, want_grad = reference("ppo", eps_low, eps_high)
    assert abs(out.loss.item() - want_loss) <= TOL
    assert_close(grad, want_grad)


@pytest.mark.parametrize("kind", ["reinforce", "ppo"])
def test_kl_to_reference_k3_with_clamp(kind):
    # token 3 has ref - logp = -6: outside the +-5 clamp (value clamped, gradient zero)
    out, grad, _ = run(policy_loss=kind, ref_logp=t(REF), kl_coef=0.3)
    want_loss, want_grad = reference(kind, kl_coef=0.3)
    assert abs(out.loss.item() - want_loss) <= TOL
    assert_close(grad, want_grad)
    ks = [
        math.exp(max(-5, min(5, r - lp))) - max(-5, min(5, r - lp)) - 1
        for r, lp, m in zip(REF, LOGP, MASK, strict=True)
        if m
    ]
    assert abs(out.stats.metrics()["kl_ref"] - sum(ks) / len(ks)) <= TOL


def test_entropy_bonus():
    out, grad, ent_grad = run(entropy=ENT, entropy_coef=0.01)
    want_loss, want_grad = reference(entropy_coef=0.01)
    assert abs(out.loss.item() - want_loss) <= TOL
    assert_close(grad, want_grad)
    assert_close(ent_grad, [(-0.01 / N_SEQ) if m else 0.0 for m in MASK])
    masked = [e for e, m in zip(ENT, MASK, strict=True) if m]
    assert abs(out.stats.metrics()["entropy"] - sum(masked) / len(masked)) <= TOL


def test_entropy_given_without_coefficient_only_feeds_stats():
    with_ent, grad, ent_grad = run(entropy=ENT)
    assert abs(with_ent.loss.item() - reference()[0]) <= TOL
    assert ent_grad is None  # not part of the graph
    assert "entropy" in with_ent.stats.metrics()


def test_overlong_filtering_zeroes_truncated_sequences_but_keeps_the_denominator():
    out, grad, _ = run(truncated=torch.tensor(TRUNC), overlong_filtering=True, ref_logp=t(REF), kl_coef=0.1)
    want_loss, want_grad = reference(kl_coef=0.1, overlong=True)
    assert abs(out.loss.item() - want_loss) <= TOL
    assert_close(grad, want_grad)
    assert grad[5:] == [0.0, 0.0, 0.0]
    assert out.stats.filtered_tokens == 3
    assert out.stats.tokens == 6  # statistics still describe every trainable token
    # off: the truncated flags are ignored
    off, _, _ = run(truncated=torch.tensor(TRUNC), overlong_filtering=False)
    assert abs(off.loss.item() - reference()[0]) <= TOL


def test_masked_positions_may_hold_inf_and_nan():
    logp = torch.tensor([float("-inf"), -1.0, float("nan")], requires_grad=True)
    behav = torch.tensor([float("nan"), -1.0, float("inf")])
    out = policy_loss(
        logp, behav, torch.tensor([5.0, 1.0, float("nan")]), torch.tensor([0, 1, 0]), num_sequences=1
    )
    out.loss.backward()
    assert math.isfinite(out.loss.item())
    assert logp.grad is not None and torch.isfinite(logp.grad).all()
    assert logp.grad.tolist() == [0.0, -1.0, 0.0]
    assert out.stats.tokens == 1 and out.stats.metrics()["ratio_mean"] == 1.0


def test_flat_and_batched_layouts_agree():
    flat, _, _ = run(policy_loss="ppo")
    logp = t(LOGP).view(2, 4)
    batched = policy_loss(
        logp,
        t(BEHAV).view(2, 4),
        t(ADV).view(2, 4),
        torch.tensor(MASK).view(2, 4),
        num_sequences=N_SEQ,
        policy_loss="ppo",
    )
    assert abs(flat.loss.item() - batched.loss.item()) <= 1e-12
    assert flat.stats == batched.stats


def test_invalid_options_are_rejected():
    logp, mask = t(LOGP), torch.tensor(MASK)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, t(BEHAV), t(ADV), mask, num_sequences=1, kl_coef=0.1)
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(logp, t(BEHAV), t(ADV), mask, num_sequences=1, entropy_coef=0.1)
    with pytest.raises(ValueError, match="truncated"):
        policy_loss(logp, t(BEHAV), t(ADV), mask, num_sequences=1, overlong_filtering=True)
    with pytest.raises(ValueError, match="shape"):
        policy_loss(logp, t(BEHAV[:3]), t(ADV), mask, num_sequences=1)
    with pytest.raises(ValueError, match="num_sequences"):
        policy_loss(logp, t(BEHAV), t(ADV), mask, num_sequences=0)


# ---------------------------------------------------------------- statistics


def test_stats_against_reference():
    out, _, _ = run()
    rhos = [math.exp(lp - b) for lp, b, m in zip(LOGP, BEHAV, MASK, strict=True) if m]
    n = len(rhos)
    got = out.stats.metrics()
    assert got["tokens"] == n
    assert abs(got["ratio_mean"] - sum(rhos) / n) <= TOL
    assert abs(got["ratio_max"] - max(rhos)) <= TOL
    assert abs(got["ess"] - sum(rhos) ** 2 / (n * sum(r * r for r in rhos))) <= TOL
    assert abs(got["kl_new_old"] - sum(r - 1 - math.log(r) for r in rhos) / n) <= TOL
    assert abs(got["mean_abs_log_ratio"] - sum(abs(math.log(r)) for r in rhos) / n) <= TOL
    assert got["clamp_fraction"] == pytest.approx(sum(r > 1.02 for r in rhos) / n)


def test_ppo_clamp_fraction_counts_only_flat_clipped_tokens():
    # A>0 & rho>1+eps: clamped; A>0 & rho<1-eps: not; A<0 & rho<1-eps: clamped; A<0 & rho>1+eps: not
    logp = t([0.0, 0.0, 0.0, 0.0])
    behav = t([-0.5, 0.5, 0.5, -0.5])
    adv = t([1.0, 1.0, -1.0, -1.0])
    stats = token_stats(logp, behav, torch.ones(4, dtype=torch.bool), advantages=adv, policy_loss="ppo")
    assert stats.clamped == 2
    assert token_stats(logp, behav, torch.ones(4, dtype=torch.bool)).clamped == 2  # reinforce: rho > 1.02


def test_on_policy_stats_are_exact():
    lp = t([-1.0, -2.0, -0.1])
    m = token_stats(lp, lp.clone(), torch.ones(3, dtype=torch.bool)).metrics()
    assert (
        m["ess"] == 1.0 and m["ratio_mean"] == 1.0 and m["kl_new_old"] == 0.0 and m["clamp_fraction"] == 0.0
    )


def test_stats_add_up_across_micro_batches():
    mask = torch.tensor(MASK)
    whole = token_stats(t(LOGP), t(BEHAV), mask, entropy=t(ENT))
    a = token_stats(t(LOGP[:4]), t(BEHAV[:4]), mask[:4], entropy=t(ENT[:4]))
    b = token_stats(t(LOGP[4:]), t(BEHAV[4:]), mask[4:], entropy=t(ENT[4:]))
    total = a + b + TokenStats()
    for key, value in whole.metrics().items():
        assert abs(total.metrics()[key] - value) <= 1e-9, key
    assert TokenStats().metrics() == {"tokens": 0.0, "filtered_tokens": 0.0}


# ---------------------------------------------------------------- one optimizer step


def toy_step(advantages, kind="reinforce"):
    """One AdamW step on a table policy: context c -> logits[c]; 4 contexts, one token each."""
    torch.manual_seed(0)
    table = torch.nn.Parameter(torch.randn(4, 6, dtype=torch.float64) * 0.1)
    opt = torch.optim.AdamW([table], lr=1e-2, weight_decay=0.0)
    contexts = torch.tensor([0, 1, 2, 3])
    labels = torch.tensor([1, 4, 2, 5])

    def logp():
        return token_logprobs(table[contexts], labels)

    before = logp().detach()
    out = policy_loss(
        logp(),
        before.clone(),
        t(advantages),
        torch.ones(4, dtype=torch.bool),
        num_sequences=4,
        policy_loss=kind,
    )
    opt.zero_grad()
    out.loss.backward()
    table_before = table.detach().clone()
    opt.step()
    return before, logp().detach(), table_before, table.detach().clone(), opt


@pytest.mark.parametrize("kind", ["reinforce", "ppo"])
def test_one_step_raises_positive_and_lowers_negative_tokens(kind):
    before, after, _, _, _ = toy_step([1.0, -1.0, 0.5, -2.0], kind)
    assert after[0] > before[0] and after[2] > before[2]
    assert after[1] < before[1] and after[3] < before[3]


def test_zero_advantages_change_only_the_optimizer_state():
    before, after, table_before, table_after, opt = toy_step([0.0, 0.0, 0.0, 0.0])
    assert torch.equal(table_before, table_after)
    assert torch.equal(before, after)
    (state,) = opt.state.values()
    assert int(state["step"]) == 1


# ---------------------------------------------------------------- logprobs and schedule


def test_token_logprobs_and_entropy():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    lp = token_logprobs(logits, torch.tensor([0, 2]), temperature=2.0)
    z = math.log(math.exp(1.0) + 1.0 + math.exp(-0.5))
    assert abs(lp[0].item() - (1.0 - z)) <= TOL
    assert abs(lp[1].item() - math.log(1 / 3)) <= TOL
    ent = token_entropy(logits)
    assert abs(ent[1].item() - math.log(3)) <= TOL
    p = [math.exp(x) / (math.exp(2) + 1 + math.exp(-1)) for x in (2.0, 0.0, -1.0)]
    assert abs(ent[0].item() - -sum(q * math.log(q) for q in p)) <= TOL
    bf16 = token_logprobs(logits.to(torch.bfloat16), torch.tensor([0, 2]))
    assert bf16.dtype == torch.float32


def test_lr_schedule_warmup_cosine_floor():
    f = make_lr_lambda(warmup_steps=4, max_steps=14, min_lr_ratio=0.1)
    assert [f(k) for k in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0)
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the cosine
    assert f(14) == pytest.approx(0.1) and f(1000) == pytest.approx(0.1)
    assert lr_factor(500, warmup_steps=0, max_steps=1000, min_lr_ratio=1.0) == 1.0
    assert pickle.loads(pickle.dumps(f))(9) == f(9)
    with pytest.raises(ValueError):
        make_lr_lambda(warmup_steps=0, max_steps=10, min_lr_ratio=1.5)


def test_lr_schedule_drives_lambda_lr():
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, make_lr_lambda(warmup_steps=2, max_steps=4, min_lr_ratio=0.0)
    )
    lrs = []
    for _ in range(5):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.25, 0.5, 0.5, 0.25, 0.0])
