"""Trainer packing: balanced rows, and packed logprobs equal per-sample unpacked logprobs."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from fakes.training import make_sample, make_tiny_model

from stream_rl.train.rows import assign_rows, pack_samples

pytestmark = pytest.mark.unit


def test_assign_rows_balances_rows() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(12, 80) for _ in range(60)]
    rows = assign_rows(lengths, 512)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(row == sorted(row) for row in rows)
    assert rows == assign_rows(lengths, 512)  # deterministic
    loads = [sum(lengths[i] for i in row) for row in rows]
    assert len(rows) == -(-sum(lengths) // 512)
    assert max(loads) - min(loads) <= max(lengths)
    assert sum(loads) / (len(rows) * max(loads)) > 0.95  # little padding


def test_one_row_when_everything_fits_and_long_samples_alone() -> None:
    assert assign_rows([5, 9, 3], 100) == [[0, 1, 2]]
    # The longest sample sets the row length: 38 tokens in rows of 30 -> 2 rows.
    assert assign_rows([30, 4, 4], 10) == [[0], [1, 2]]


def test_pack_layout_positions_and_labels() -> None:
    rng = random.Random(1)
    samples = [make_sample(rng, key=f"g{i}") for i in range(5)]
    packed = pack_samples(samples, row_tokens=40)
    assert packed.real_tokens == sum(len(s.input_ids) for s in samples)
    assert packed.padded_tokens == packed.input_ids.numel() >= packed.real_tokens
    n = sum(s.completion_len for s in samples)
    assert packed.labels.shape == (n,)
    # Each label is the token right after its predicting position, and positions restart.
    nxt = packed.input_ids[packed.rows, packed.cols + 1]
    assert torch.equal(nxt, packed.labels)
    assert (packed.position_ids[:, 0] == 0).all()
    expected_labels = [t for s in samples for t in s.input_ids[s.prompt_len :]]
    assert packed.labels.tolist() == expected_labels
    assert packed.loss_mask.tolist() == [m for s in samples for m in s.loss_mask]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_equal_unpacked(tmp_path: Path, attn: str) -> None:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    make_tiny_model(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), attn_implementation=attn).eval()
    rng = random.Random(7)
    samples = [make_sample(rng, key=f"g{i}") for i in range(6)]
    temperature = 0.7
    # Small rows: several rows, with padding, so both cross-sample and padding isolation count.
    packed = pack_samples(samples, row_tokens=48)
    assert packed.input_ids.shape[0] > 1 and packed.fill < 1.0
    with torch.no_grad():
        hidden = model.get_decoder()(
            input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False
        ).last_hidden_state
        logits = model.get_output_embeddings()(hidden[packed.rows, packed.cols])
        got = torch.log_softmax(logits / temperature, -1).gather(-1, packed.labels[:, None])[:, 0]
        ref = []
        for s in samples:
            full = model(torch.tensor([s.input_ids])).logits[0]
            lp = torch.log_softmax(full[s.prompt_len - 1 : -1] / temperature, -1)
            ref.append(lp.gather(-1, torch.tensor(s.input_ids[s.prompt_len :])[:, None])[:, 0])
    assert torch.allclose(got, torch.cat(ref), atol=1e-6, rtol=0)
