"""GSPO and CISPO against float64 references written from the papers' formulas, their statistics
and their config keys.

The references are scalar loops. GSPO's is the paper's *sequence-level* objective (one clipped
term per sequence, no stop-gradient), and its gradient is taken by central finite differences,
so the test checks that the loss's GSPO-token form has the paper's value and gradient. CISPO's
weight is stop-gradiented, so its gradient is written out: `-sg(w) * A / num_sequences`.
"""

import math
import typing

import pytest
import torch

from stream_rl.config import TrainerConfig, dump_config, load_config
from stream_rl.errors import ConfigError
from stream_rl.rl.losses import CLIP_DEFAULTS, PolicyLossKind, policy_loss
from stream_rl.rl.stats import token_stats

pytestmark = pytest.mark.unit

torch.set_num_threads(1)

# One packed row, flat: 3 sequences of 4, 7 and 3 tokens. Masked: each sequence's first token
# (prompt), and token 9 (an environment token inside sequence 1). Masked positions hold inf/NaN.
SEQ = [0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2]
MASK = [False, True, True, True, False, True, True, True, True, False, True, False, True, True]
LOGP = [-9.0, -1.0, -0.5, -2.0, -9.0, -0.3, -1.5, -0.05, -0.7, float("-inf"), -1.1, -9.0, -0.9, -0.2]
ADV = [0.0, 1.5, 1.5, 1.5, 0.0, -0.8, -0.8, -0.8, -0.8, -0.8, -0.8, 0.0, 0.6, 0.6]
REF = [0.0, -1.2, -0.1, -8.0, 0.0, -0.3, -1.0, -0.5, -0.6, 0.0, -1.0, 0.0, -0.95, -0.4]
ENT = [0.0, 0.7, 0.2, 1.1, 0.0, 0.9, 0.4, 0.05, 0.3, 0.0, 0.6, 0.0, 0.8, 0.1]
TRUNC = [False] * 11 + [True] * 3  # sequence 2 hit max_tokens
N_SEQ = 5  # sequences in the optimizer step (more than in this micro-batch)

# logp - behaviour_logp at the trainable tokens, per case (the masked ones get NaN behaviour).
# With GSPO's default range [1 - 3e-4, 1 + 4e-4], mean log ratios per sequence give:
#   near: s0 = e^2e-4 inside; s1 = e^1e-3 above with A < 0 (unclipped branch); s2 = e^1e-2 above
#         with A > 0 (clipped: no gradient)
#   below: s0 = e^-2e-4 inside; s1 = e^-1e-3 below with A < 0 (clipped); s2 below with A > 0 (not)
#   far: token ratios from e^-0.6 to e^0.5, for CISPO's bounds and wide GSPO ranges
DELTAS = {
    "near": [5e-4, -3e-4, 4e-4, 3e-3, -1e-3, 2e-3, 0.0, 1e-3, 0.02, 0.0],
    "below": [-5e-4, 3e-4, -4e-4, -3e-3, 1e-3, -2e-3, 0.0, -1e-3, -0.02, 0.0],
    "far": [0.5, -0.3, 0.1, -0.2, 0.4, 0.05, -0.6, 0.3, 0.25, -0.15],
}
TRAINABLE = [i for i, m in enumerate(MASK) if m]


def behaviour(case: str) -> list[float]:
    out = [float("nan")] * len(LOGP)
    for i, d in zip(TRAINABLE, DELTAS[case], strict=True):
        out[i] = LOGP[i] - d
    return out


def k3(ref: float, lp: float) -> float:
    d = max(-5.0, min(5.0, ref - lp))
    return math.exp(d) - d - 1


def gspo_reference(logp, behav, eps_low, eps_high, kl_coef=0.0, entropy_coef=0.0, overlong=False):
    """The paper's sequence-level GSPO loss: -sum_i min(s_i A_i, clip(s_i) A_i) / num_sequences,
    s_i = exp(mean_t (logp - behaviour)); KL and entropy as per-sequence token means."""
    total = 0.0
    for seq in sorted(set(SEQ)):
        toks = [i for i in TRAINABLE if SEQ[i] == seq]
        if overlong and TRUNC[toks[0]]:
            continue
        n = len(toks)
        s = math.exp(sum(logp[i] - behav[i] for i in toks) / n)
        a = ADV[toks[0]]
        obj = min(s * a, min(max(s, 1 - eps_low), 1 + eps_high) * a)
        obj -= kl_coef * sum(k3(REF[i], logp[i]) for i in toks) / n
        obj += entropy_coef * sum(ENT[i] for i in toks) / n
        total += obj
    return -total / N_SEQ


def finite_difference_grad(f, logp, h=1e-6):
    grads = [0.0] * len(logp)
    for i in TRAINABLE:
        up, down = list(logp), list(logp)
        up[i] += h
        down[i] -= h
        grads[i] = (f(up) - f(down)) / (2 * h)
    return grads


def cispo_reference(behav, eps_low, eps_high, kl_coef=0.0, entropy_coef=0.0, overlong=False):
    """MiniMax-M1's per-token objective sg(clip(rho, 1 - eps_low, 1 + eps_high)) * A * logp (no
    lower bound when eps_low is None), summed over tokens, / num_sequences; and its gradient."""
    total, grads = 0.0, [0.0] * len(LOGP)
    for i in TRAINABLE:
        if overlong and TRUNC[i]:
            continue
        lp, a = LOGP[i], ADV[i]
        rho = math.exp(lp - behav[i])
        w = min(rho if eps_low is None else max(rho, 1 - eps_low), 1 + eps_high)
        obj, dobj = w * a * lp, w * a
        if kl_coef:
            obj -= kl_coef * k3(REF[i], lp)
            dobj -= kl_coef * ((1 - math.exp(REF[i] - lp)) if abs(REF[i] - lp) < 5 else 0.0)
        obj += entropy_coef * ENT[i]
        total += obj
        grads[i] = -dobj / N_SEQ
    return -total / N_SEQ, grads


def t(values, requires_grad=False):
    return torch.tensor(values, dtype=torch.float64, requires_grad=requires_grad)


def run(kind, case, shape=None, **kwargs):
    """The loss on the packed row (or `shape`d), with its gradient w.r.t. logp (flat)."""
    logp = t(LOGP, requires_grad=True)
    tensors = [logp, t(behaviour(case)), t(ADV), torch.tensor(MASK), torch.tensor(SEQ)]
    extra = {}
    if kwargs.get("kl_coef"):
        extra["ref_logp"] = t(REF)
    if kwargs.get("entropy_coef"):
        extra["entropy"] = t(ENT)
    if kwargs.get("overlong_filtering"):
        extra["truncated"] = torch.tensor(TRUNC)
    if shape is not None:
        tensors = [x.view(shape) for x in tensors]
        extra = {k: v.view(shape) for k, v in extra.items()}
    lp, blp, adv, mask, ids = tensors
    out = policy_loss(
        lp, blp, adv, mask, num_sequences=N_SEQ, policy_loss=kind, sequence_ids=ids, **extra, **kwargs
    )
    out.loss.backward()
    assert logp.grad is not None
    return out, logp.grad.tolist()


def assert_close(got, want, tol):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert abs(g - w) <= tol, (got, want)


# ---------------------------------------------------------------- GSPO


@pytest.mark.parametrize(
    "case,eps_low,eps_high",
    [
        ("near", None, None),
        ("below", None, None),
        ("near", 0.2, 0.28),
        ("far", 0.2, 0.28),
        ("far", 0.1, 0.05),
    ],
)
def test_gspo_matches_the_sequence_level_formula(case, eps_low, eps_high):
    low = CLIP_DEFAULTS["gspo"][0] if eps_low is None else eps_low
    high = CLIP_DEFAULTS["gspo"][1] if eps_high is None else eps_high
    out, grad = run("gspo", case, eps_low=eps_low, eps_high=eps_high)
    behav = behaviour(case)
    want = gspo_reference(LOGP, behav, low, high)
    want_grad = finite_difference_grad(lambda lp: gspo_reference(lp, behav, low, high), LOGP)
    assert abs(out.loss.item() - want) <= 1e-9
    assert_close(grad, want_grad, 1e-7)


def test_gspo_default_range_clips_whole_sequences():
    # near: sequence 2 (A > 0, s above 1 + 4e-4) is clipped; below: sequence 1 (A < 0, s below)
    _, grad = run("gspo", "near")
    assert all(grad[i] == 0.0 for i in (12, 13)) and all(grad[i] != 0.0 for i in TRAINABLE[:8])
    _, grad = run("gspo", "below")
    assert all(grad[i] == 0.0 for i in (5, 6, 7, 8, 10))
    assert all(grad[i] != 0.0 for i in (1, 2, 3, 12, 13))
    # and an unclipped sequence's tokens share one gradient, s * A / |y| / num_sequences
    s0 = math.exp(sum(DELTAS["near"][:3]) / 3)
    _, grad = run("gspo", "near")
    assert_close([grad[i] for i in (1, 2, 3)], [-s0 * 1.5 / 3 / N_SEQ] * 3, 1e-12)


def test_gspo_with_kl_entropy_and_overlong_filtering():
    low, high = 0.2, 0.28
    kw = {"kl_coef": 0.3, "entropy_coef": 0.01, "overlong_filtering": True}
    out, grad = run("gspo", "far", eps_low=low, eps_high=high, **kw)
    behav = behaviour("far")
    ref_kw = {"kl_coef": 0.3, "entropy_coef": 0.01, "overlong": True}
    want = gspo_reference(LOGP, behav, low, high, **ref_kw)
    want_grad = finite_difference_grad(lambda lp: gspo_reference(lp, behav, low, high, **ref_kw), LOGP)
    assert abs(out.loss.item() - want) <= 1e-9
    assert_close(grad, want_grad, 1e-7)
    assert grad[12:] == [0.0, 0.0]  # the truncated sequence is dropped...
    assert out.stats.filtered_tokens == 2 and out.stats.sequences == 3  # ...but described


def test_gspo_on_batched_rows_and_in_any_token_order():
    flat, flat_grad = run("gspo", "far", eps_low=0.1, eps_high=0.05)
    # [2, 7]: row 0 holds sequence 0 and the first 3 tokens of sequence 1, row 1 the rest: the
    # sequence ids, not the rows, define the sequences
    batched, batched_grad = run("gspo", "far", shape=(2, 7), eps_low=0.1, eps_high=0.05)
    assert abs(flat.loss.item() - batched.loss.item()) <= 1e-12
    assert_close(batched_grad, flat_grad, 1e-12)
    assert flat.stats == batched.stats
    # padded [2, 9], tokens reordered: sequence 1 then half of sequence 0 in row 0, sequence 2,
    # the other half of sequence 0 and 4 padding tokens (NaN, an id of their own) in row 1
    order = [4, 5, 6, 7, 8, 9, 10, 0, 1] + [11, 12, 13, 2, 3] + [-1] * 4
    pick = lambda xs, pad: [xs[i] if i >= 0 else pad for i in order]  # noqa: E731
    logp = t(pick(LOGP, float("nan")), requires_grad=True)
    out = policy_loss(
        logp.view(2, 9),
        t(pick(behaviour("far"), float("nan"))).view(2, 9),
        t(pick(ADV, 0.0)).view(2, 9),
        torch.tensor(pick(MASK, False)).view(2, 9),
        num_sequences=N_SEQ,
        policy_loss="gspo",
        eps_low=0.1,
        eps_high=0.05,
        sequence_ids=torch.tensor(pick(SEQ, 7)).view(2, 9),
    )
    out.loss.backward()
    assert abs(out.loss.item() - flat.loss.item()) <= 1e-12
    assert logp.grad is not None
    assert_close(logp.grad.tolist(), pick(flat_grad, 0.0), 1e-12)


def test_gspo_stats_clip_per_sequence():
    for case, clipped_seq in (("near", 2), ("below", 1)):
        out, _ = run("gspo", case)
        seq_tokens = [i for i in TRAINABLE if SEQ[i] == clipped_seq]
        assert out.stats.clamped == len(seq_tokens)
        assert out.stats.metrics()["clamp_fraction"] == pytest.approx(len(seq_tokens) / len(TRAINABLE))
    out, _ = run("gspo", "near")
    sums = {}
    for i, d in zip(TRAINABLE, DELTAS["near"], strict=True):
        sums.setdefault(SEQ[i], []).append(d)
    s = [math.exp(sum(v) / len(v)) for v in sums.values()]
    assert out.stats.sequences == 3
    assert out.stats.metrics()["seq_ratio_mean"] == pytest.approx(sum(s) / 3, abs=1e-12)
    # the same micro-batch cut in two adds up
    mask, ids = torch.tensor(MASK), torch.tensor(SEQ)
    args = (t(LOGP), t(behaviour("near")), mask)
    kw = {"advantages": t(ADV), "policy_loss": "gspo", "eps_low": 3e-4, "eps_high": 4e-4}
    whole = token_stats(*args, sequence_ids=ids, **kw)
    parts = [
        token_stats(*(x[sl] for x in args), sequence_ids=ids[sl], **{**kw, "advantages": t(ADV)[sl]})
        for sl in (slice(0, 11), slice(11, 14))
    ]
    assert (parts[0] + parts[1]).metrics() == pytest.approx(whole.metrics())


def test_gspo_needs_sequence_ids():
    mask = torch.tensor(MASK)
    with pytest.raises(ValueError, match="sequence_ids"):
        policy_loss(t(LOGP), t(behaviour("near")), t(ADV), mask, num_sequences=1, policy_loss="gspo")
    with pytest.raises(ValueError, match="shape"):
        policy_loss(
            t(LOGP),
            t(behaviour("near")),
            t(ADV),
            mask,
            num_sequences=1,
            policy_loss="gspo",
            sequence_ids=torch.tensor(SEQ[:5]),
        )


# ---------------------------------------------------------------- CISPO


@pytest.mark.parametrize("eps_low,eps_high", [(None, None), (None, 0.05), (0.1, 0.05), (0.5, 1.0)])
def test_cispo_matches_the_formula(eps_low, eps_high):
    high = CLIP_DEFAULTS["cispo"][1] if eps_high is None else eps_high
    out, grad = run("cispo", "far", eps_low=eps_low, eps_high=eps_high)
    want, want_grad = cispo_reference(behaviour("far"), eps_low, high)
    assert abs(out.loss.item() - want) <= 1e-9
    assert_close(grad, want_grad, 1e-12)
    assert all(grad[i] != 0.0 for i in TRAINABLE)  # no token's gradient is ever zeroed


def test_cispo_bounds_the_weight_on_both_sides_only_when_asked():
    # rho = e^-0.6 = 0.55 (token 8): with eps_low 0.25 its weight is 0.75, without it stays 0.55
    _, grad = run("cispo", "far", eps_low=0.25, eps_high=0.2)
    assert grad[8] == pytest.approx(-0.75 * -0.8 / N_SEQ, abs=1e-12)
    _, grad = run("cispo", "far", eps_high=0.2)
    assert grad[8] == pytest.approx(-math.exp(-0.6) * -0.8 / N_SEQ, abs=1e-12)
    # statistics: the weights cut, above 1.2 (4 tokens) and, with eps_low, below 0.75 (2 more)
    rhos = [math.exp(d) for d in DELTAS["far"]]
    out, _ = run("cispo", "far", eps_low=0.25, eps_high=0.2)
    assert out.stats.clamped == sum(r > 1.2 or r < 0.75 for r in rhos) == 6
    out, _ = run("cispo", "far", eps_high=0.2)
    assert out.stats.clamped == sum(r > 1.2 for r in rhos) == 4


def test_cispo_without_lower_bound_is_reinforce():
    for case in DELTAS:
        cispo, cispo_grad = run("cispo", case, eps_high=0.02)
        reinforce, reinforce_grad = run("reinforce", case)
        assert cispo.loss.item() == reinforce.loss.item()
        assert cispo_grad == reinforce_grad
        assert cispo.stats == reinforce.stats


def test_cispo_with_kl_entropy_and_overlong_filtering():
    kw = {"kl_coef": 0.3, "entropy_coef": 0.01, "overlong_filtering": True}
    out, grad = run("cispo", "far", eps_low=0.1, eps_high=0.05, **kw)
    want, want_grad = cispo_reference(
        behaviour("far"), 0.1, 0.05, kl_coef=0.3, entropy_coef=0.01, overlong=True
    )
    assert abs(out.loss.item() - want) <= 1e-9
    assert_close(grad, want_grad, 1e-12)
    assert grad[12:] == [0.0, 0.0] and out.stats.filtered_tokens == 2


def test_cispo_on_batched_rows():
    flat, flat_grad = run("cispo", "far", eps_low=0.1)
    batched, batched_grad = run("cispo", "far", shape=(2, 7), eps_low=0.1)
    assert abs(flat.loss.item() - batched.loss.item()) <= 1e-12
    assert_close(batched_grad, flat_grad, 1e-12)


# ---------------------------------------------------------------- config


def test_losses_and_config_offer_the_same_names():
    names = typing.get_args(TrainerConfig.model_fields["policy_loss"].annotation)
    assert set(names) == set(typing.get_args(PolicyLossKind)) == set(CLIP_DEFAULTS)


@pytest.mark.parametrize("kind", ["gspo", "cispo"])
def test_config_loads_each_loss_and_round_trips(kind, tmp_path):
    cfg = load_config(None, [f"trainer.policy_loss={kind}"])
    assert cfg.trainer.policy_loss == kind
    assert cfg.trainer.eps_low is None and cfg.trainer.eps_high is None  # the loss's defaults
    path = tmp_path / "run.yaml"
    path.write_text(dump_config(cfg))  # what the launcher writes into a run directory
    assert load_config(path).trainer == cfg.trainer
    tuned = load_config(None, [f"trainer.policy_loss={kind}", "trainer.eps_low=0.001"])
    assert tuned.trainer.eps_low == 0.001


def test_config_refuses_a_bad_loss_and_a_lower_clip_for_reinforce():
    with pytest.raises(ConfigError) as bad:
        load_config(None, ["trainer.policy_loss=grpo"])
    assert "\n" not in str(bad.value)
    assert "trainer.policy_loss" in str(bad.value) and "'gspo'" in str(bad.value)
    with pytest.raises(ConfigError) as ignored:
        load_config(None, ["trainer.eps_low=0.1"])  # reinforce, the default loss
    assert "\n" not in str(ignored.value) and "trainer.eps_low" in str(ignored.value)
    with pytest.raises(ValueError, match="eps_low"):
        policy_loss(t(LOGP), t(behaviour("near")), t(ADV), torch.tensor(MASK), num_sequences=1, eps_low=0.1)
