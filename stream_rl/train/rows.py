"""Pack a micro-batch's samples into rows for one forward pass (pure torch, CPU tensors).

Layout:
- Samples are spread over `ceil(tokens / max(row_tokens, longest sample))` rows, balanced
  (`assign_rows`), and rows are right-padded to the longest with token 0. Shorter rows cost less attention (each row's
  attention is quadratic in its length, across the samples it holds: the mask hides other
  samples but sdpa on CPU still computes them), longer rows pad less: `bench/trainer.py`.
- `position_ids` restart at 0 for every sample, and the padding of a row is one more segment
  with its own positions 0, 1, ... . Given `position_ids` and no attention mask, transformers'
  causal-LM masking (`find_packed_sequence_indices`, sdpa and eager alike) builds the
  block-diagonal causal mask from the restarts, so a sample never attends to another one or to
  padding. `tests/unit/test_rows.py` checks packed logprobs against unpacked ones.
- A sample longer than `row_tokens` gets a forward pass of its own (`pack_forwards`): packed
  with the others it would set every row's length, so the rows of short samples would be padded
  to it and attention would cost `rows x longest^2`. Alone, it costs its own length and no
  padding, and the short ones keep their `row_tokens` rows. Every sample is in exactly one pass;
  the trainer sums the passes' losses (`stream_rl/train/step.py`), so the result is the loss of
  the whole micro-batch.
- Completion token t of a sample (`input_ids[prompt_len + t]`) is predicted by the hidden state
  of the position before it; `rows`/`cols` index those predicting positions, so the LM head runs
  on completion positions only. The flat per-token tensors (`labels`, `loss_mask`, ...) follow
  the samples in their original order, then token order: they are completion-aligned exactly
  like `TrainingSample`'s arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from stream_rl.contracts import TrainingSample, token_versions

PAD_TOKEN_ID = 0
"""Padding id: any valid id works, padding positions are never attended to nor scored."""


@dataclass
class PackedBatch:
    input_ids: torch.Tensor
    """[R, T] token ids of the rows."""
    position_ids: torch.Tensor
    """[R, T] positions, restarting at 0 for every sample (and for the padding)."""
    rows: torch.Tensor
    """[N] row of the position that predicts each completion token."""
    cols: torch.Tensor
    """[N] column of that position (the token before the scored one)."""
    labels: torch.Tensor
    """[N] the completion tokens."""
    loss_mask: torch.Tensor
    """[N] bool: trainable tokens."""
    advantages: torch.Tensor
    """[N] float32."""
    behaviour_logprobs: torch.Tensor
    """[N] float32: the engine's logprobs."""
    truncated: torch.Tensor
    """[N] bool: the token's sample hit max_tokens (finish_reason `length`)."""
    token_versions: torch.Tensor
    """[N] int64: the policy version that sampled each token."""
    sample_of_token: torch.Tensor
    """[N] int64: index of the token's sample in the micro-batch."""
    num_samples: int
    real_tokens: int
    """Tokens of the samples (prompt and completion), padding excluded."""

    @property
    def padded_tokens(self) -> int:
        """Tokens the forward pass processes, padding included (R * T)."""
        return int(self.input_ids.numel())

    @property
    def fill(self) -> float:
        """Fraction of non-padding tokens in the rows."""
        return self.real_tokens / self.padded_tokens if self.padded_tokens else 1.0


def assign_rows(lengths: Sequence[int], row_tokens: int) -> list[list[int]]:
    """Sample indices per row: `ceil(total / width)` rows, `width = max(row_tokens, longest
    sample)`, balanced by longest-first greedy assignment to the least-filled row (ties by row
    index: deterministic). Rows come out about `width` long (one may exceed it by less than a
    sample); since rows are padded to the longest, balancing them is what keeps padding low.
    Within a row, samples keep their order."""
    if row_tokens < 1:
        raise ValueError(f"row_tokens must be >= 1, got {row_tokens}")
    # A sample longer than row_tokens sets the row length: every row is padded to it anyway.
    width = max(row_tokens, max(lengths, default=0))
    n_rows = max(1, -(-sum(lengths) // width))
    rows: list[list[int]] = [[] for _ in range(n_rows)]
    loads = [0] * n_rows
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(n_rows), key=lambda r: (loads[r], r))
        rows[r].append(i)
        loads[r] += lengths[i]
    return [sorted(r) for r in rows if r]


def pack_forwards(samples: Sequence[TrainingSample], row_tokens: int) -> list[tuple[PackedBatch, list[int]]]:
    """The forward passes of a micro-batch, each with the indices of its samples (in the order
    its flat tensors follow): each sample longer than `row_tokens` alone, in the order given,
    then the others packed together (`pack_samples`). Every sample is in exactly one pass."""
    if not samples:
        raise ValueError("pack_forwards: no samples")
    long = [[i] for i, s in enumerate(samples) if len(s.input_ids) > row_tokens]
    short = [i for i, s in enumerate(samples) if len(s.input_ids) <= row_tokens]
    parts = long + ([short] if short else [])
    return [(pack_samples([samples[i] for i in part], row_tokens), part) for part in parts]


def pack_samples(samples: Sequence[TrainingSample], row_tokens: int) -> PackedBatch:
    """Pack `samples` (validated `TrainingSample`s, at least one) into rows; see the module doc."""
    if not samples:
        raise ValueError("pack_samples: no samples")
    lengths = [len(s.input_ids) for s in samples]
    layout = assign_rows(lengths, row_tokens)
    width = max(sum(lengths[i] for i in row) for row in layout)
    input_ids = torch.full((len(layout), width), PAD_TOKEN_ID, dtype=torch.long)
    position_ids = torch.empty((len(layout), width), dtype=torch.long)
    where: dict[int, tuple[int, int]] = {}
    for r, row in enumerate(layout):
        col = 0
        for i in row:
            n = lengths[i]
            input_ids[r, col : col + n] = torch.tensor(samples[i].input_ids, dtype=torch.long)
            position_ids[r, col : col + n] = torch.arange(n)
            where[i] = (r, col)
            col += n
        position_ids[r, col:] = torch.arange(width - col)

    rows: list[int] = []
    cols: list[int] = []
    labels: list[int] = []
    mask: list[bool] = []
    adv: list[float] = []
    blp: list[float] = []
    trunc: list[bool] = []
    versions: list[int] = []
    owner: list[int] = []
    for i, s in enumerate(samples):
        r, start = where[i]
        n = s.completion_len
        rows.extend([r] * n)
        cols.extend(range(start + s.prompt_len - 1, start + lengths[i] - 1))
        labels.extend(s.input_ids[s.prompt_len :])
        mask.extend(s.loss_mask)
        adv.extend(s.advantages)
        blp.extend(s.behaviour_logprobs)
        trunc.extend([s.finish_reason == "length"] * n)
        versions.extend(token_versions(s.version_spans, n))
        owner.extend([i] * n)
    return PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        rows=torch.tensor(rows, dtype=torch.long),
        cols=torch.tensor(cols, dtype=torch.long),
        labels=torch.tensor(labels, dtype=torch.long),
        loss_mask=torch.tensor(mask, dtype=torch.bool),
        advantages=torch.tensor(adv, dtype=torch.float32),
        behaviour_logprobs=torch.tensor(blp, dtype=torch.float32),
        truncated=torch.tensor(trunc, dtype=torch.bool),
        token_versions=torch.tensor(versions, dtype=torch.long),
        sample_of_token=torch.tensor(owner, dtype=torch.long),
        num_samples=len(samples),
        real_tokens=sum(lengths),
    )
