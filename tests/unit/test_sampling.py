"""The sampler's contract: greedy at T=0, logprobs of the full log_softmax(logits/T), exact
softmax(logits/T) draws, seeded reproducibility, top-k/top-p truncation."""

from __future__ import annotations

import pytest
import torch

from stream_rl.inference.sampling import BatchSampling, sample, truncation_mask

pytestmark = pytest.mark.unit


def params(temps: list[float], *, top_k=None, top_p=None, generators=None, top_logprobs=0) -> BatchSampling:
    return BatchSampling(
        temperature=torch.tensor(temps),
        top_k=None if top_k is None else torch.tensor(top_k),
        top_p=None if top_p is None else torch.tensor(top_p),
        generators=generators or [None] * len(temps),
        any_sampled=any(t > 0 for t in temps),
        top_logprobs=top_logprobs,
    )


def test_temperature_zero_is_argmax_with_logprob_of_plain_softmax() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    out = sample(logits, params([0.0] * 8), torch.Generator().manual_seed(1))
    assert out.tokens.tolist() == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).gather(1, out.tokens[:, None])[:, 0]
    torch.testing.assert_close(out.logprobs, expected)


def test_logprobs_are_full_log_softmax_at_the_sampled_ids() -> None:
    logits = torch.randn(16, 30, generator=torch.Generator().manual_seed(0)) * 3
    temps = [0.5, 1.0, 1.7, 0.0] * 4
    out = sample(logits, params(temps), torch.Generator().manual_seed(2))
    for row, t in enumerate(temps):
        ref = torch.log_softmax(logits[row] / (t or 1.0), -1)[out.tokens[row]]
        assert out.logprobs[row].item() == pytest.approx(ref.item(), abs=1e-6)


def test_draws_follow_softmax_of_logits_over_temperature() -> None:
    rows, t = 40_000, 0.7
    base = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    out = sample(base.repeat(rows, 1), params([t] * rows), torch.Generator().manual_seed(3))
    freq = torch.bincount(out.tokens, minlength=5).double() / rows
    expected = torch.softmax(base.double() / t, -1)
    # 4 standard errors of a binomial proportion.
    tolerance = 4 * (expected * (1 - expected) / rows).sqrt()
    assert ((freq - expected).abs() <= tolerance).all(), (freq, expected)


def test_seeded_rows_reproduce_whatever_shares_the_batch() -> None:
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))

    def draw(batch: torch.Tensor, seeded_row: int) -> int:
        gens = [None] * batch.shape[0]
        gens[seeded_row] = torch.Generator().manual_seed(1234)
        out = sample(
            batch, params([1.0] * batch.shape[0], generators=gens), torch.Generator().manual_seed(99)
        )
        return int(out.tokens[seeded_row])

    alone = [draw(logits[i : i + 1], 0) for i in range(6)]
    together = [draw(logits, i) for i in range(6)]
    assert alone == together
    # Different seeds give different streams (with 40 ids and 6 rows a full collision is negligible).
    other = [
        int(sample(logits[i : i + 1], params([1.0], generators=[torch.Generator().manual_seed(7)])).tokens[0])
        for i in range(6)
    ]
    assert other != alone


def test_top_k_samples_only_the_k_most_likely_but_reports_full_logprobs() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(2000, 1)
    out = sample(logits, params([1.0] * 2000, top_k=[2] * 2000), torch.Generator().manual_seed(4))
    assert set(out.tokens.tolist()) == {0, 1}
    full = torch.log_softmax(logits[0], -1)
    assert out.logprobs.tolist() == [full[t].item() for t in out.tokens.tolist()]


def test_truncation_mask_top_p_keeps_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]])
    logp = probs.log()
    removed = truncation_mask(logp, None, torch.tensor([0.79, 0.81, 0.4]))
    assert removed.tolist() == [
        [False, False, True, True],  # 0.5 + 0.3 reaches 0.79
        [False, False, False, True],  # needs the third
        [True, True, True, False],  # the most likely alone reaches 0.4
    ]


def test_truncation_mask_top_k_and_off_rows() -> None:
    logp = torch.log_softmax(torch.tensor([[1.0, 4.0, 2.0, 3.0], [1.0, 4.0, 2.0, 3.0]]), -1)
    removed = truncation_mask(logp, torch.tensor([2, 0]), torch.tensor([1.0, 1.0]))
    assert removed.tolist() == [[True, False, True, False], [False, False, False, False]]


def test_top_logprobs_are_the_best_alternatives() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    out = sample(logits, params([1.0], top_logprobs=2))
    assert out.top_ids is not None and out.top_logprobs is not None
    assert out.top_ids.tolist() == [[1, 3]]
    torch.testing.assert_close(out.top_logprobs[0], torch.log_softmax(logits[0], -1)[[1, 3]])
