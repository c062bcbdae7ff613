"""The running batch: sequences in KV slots and the forward passes over them (engine thread only).

Sequence i of `running` lives in KV slot i (kv.py). `prefill()` adds requests' sequences at the
end and samples each one's first token; `decode()` feeds every running sequence its last token
and samples the next; `retire()` removes finished ones and moves the tail into the holes so the
batch stays compact; `recompute()` rebuilds every slot's KV under the current weights. Every
sampled token is tagged with the `version` passed in (sequence.py records the spans).

Prefill forwards are bounded by `prefill_tokens` padded tokens (rows x longest row): prompts and
recomputed sequences are grouped by length so that one long sequence does not pad a whole
group to its length, and a single row longer than the budget is written in chunks of
`prefill_tokens` (kv.py `prepare_extend`), so a long multi-turn context never needs a
`length x length` attention matrix.
"""

from __future__ import annotations

from typing import Any

import torch

from stream_rl.errors import InferenceError
from stream_rl.inference.kv import SlotCache
from stream_rl.inference.requests import Request
from stream_rl.inference.running_sequence import Sequence
from stream_rl.inference.sampling import BatchSampling, sample

DECODE_SHAPES = ("running", "fixed")
"""`inference.decode_shape`: a decode step over the running sequences, or over every slot."""


def cache_keyword(model: Any) -> str:
    """The keyword under which the model's forward takes its KV cache: `cache` from transformers
    5.24 (5.20 to 5.23, the releases vLLM 0.33 allows, call it `past_key_values`, and ignore a
    `cache` keyword: a forward then runs without our slots)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def keeps_positions_per_row() -> bool:
    """Whether this transformers takes a `(batch, n)` tensor of `logits_to_keep` as positions per
    row (5.24's `slice_logits_to_keep`); older releases index every row with the whole tensor."""
    from transformers import modeling_utils

    return hasattr(modeling_utils, "slice_logits_to_keep")


def eos_ids_of(model: Any, tokenizer: Any) -> frozenset[int]:
    """The ids that end a sequence: the generation config's eos ids and the tokenizer's."""
    ids: set[int] = set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update([eos] if isinstance(eos, int) else (eos or []))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


class Batch:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_batch: int,
        max_len: int,
        prefill_tokens: int,
        generator: torch.Generator,
        decode_shape: str = "running",
    ) -> None:
        if decode_shape not in DECODE_SHAPES:
            raise InferenceError(
                f"decode_shape must be one of {', '.join(DECODE_SHAPES)}, got {decode_shape!r}"
            )
        config = model.config.get_text_config()
        self.model = model
        self.max_batch = max_batch
        self.fixed_shape = decode_shape == "fixed"
        self._cache_kw = cache_keyword(model)
        self._rows_keep = keeps_positions_per_row()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.max_len = max_len
        self.prefill_tokens = prefill_tokens
        self.eos_ids = eos_ids_of(model, tokenizer)
        self.generator = generator
        heads = config.num_attention_heads
        self.cache = SlotCache(
            num_layers=config.num_hidden_layers,
            slots=max_batch,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            max_len=max_len,
            dtype=next(model.parameters()).dtype,
            device=self.device,
        )
        self.running: list[Sequence] = []
        self._sampling: BatchSampling | None = None  # rebuilt when the running set changes

    def __len__(self) -> int:
        return len(self.running)

    # -- forward passes ------------------------------------------------------------------------
    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, **kw: Any
    ) -> torch.Tensor:
        args = dict(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, **kw)
        args[self._cache_kw] = self.cache
        keep = kw.get("logits_to_keep")
        if isinstance(keep, torch.Tensor) and not self._rows_keep:
            # Before transformers 5.24 a tensor `logits_to_keep` selects the same positions in every
            # row: run the decoder, take each row's own position, and project that alone.
            del args["logits_to_keep"]
            hidden = self.model.get_decoder()(**args).last_hidden_state
            return self.model.get_output_embeddings()(torch.take_along_dim(hidden, keep[..., None], dim=1))[
                :, -1
            ]
        return self.model(**args).logits[:, -1]

    def _prefill_rows(self, rows: list[list[int]], slots: list[int]) -> torch.Tensor:
        """Run token rows (right-padded) into `slots` from position 0; logits at each row's end.
        The caller keeps `len(rows) x longest` within `prefill_tokens` unless there is one row."""
        device = self.device
        length = max(len(r) for r in rows)
        if len(rows) == 1 and length > self.prefill_tokens:
            return self._prefill_chunked(rows[0], slots[0])
        ids = torch.zeros((len(rows), length), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
        last = torch.tensor([[len(r) - 1] for r in rows], device=device)
        # Causal attention alone suffices: a row's real tokens precede its padding.
        causal = torch.ones((length, length), dtype=torch.bool, device=device).tril()[None, None]
        self.cache.prepare_prefill(torch.tensor(slots, device=device), length)
        positions = torch.arange(length, device=device)[None].expand(len(rows), length)
        return self._forward(ids.to(device), positions, causal, logits_to_keep=last)

    def _prefill_chunked(self, row: list[int], slot: int) -> torch.Tensor:
        """Run one long row into `slot` in chunks of `prefill_tokens`; logits at its last token."""
        device = self.device
        chunk = self.prefill_tokens
        logits = torch.empty(0)
        for start in range(0, len(row), chunk):
            piece = row[start : start + chunk]
            end = start + len(piece)
            positions = torch.arange(start, end, device=device)
            mask = (torch.arange(end, device=device)[None, :] <= positions[:, None])[None, None]
            self.cache.prepare_extend(slot, start, len(piece))
            ids = torch.tensor([piece], device=device)
            logits = self._forward(ids, positions[None], mask, logits_to_keep=1)
        return logits

    def prefill(self, requests: list[Request], version: int) -> int:
        """Add the requests' sequences (n each) and sample their first tokens; returns tokens sampled."""
        sampled = 0
        group: list[Request] = []
        for request in requests:  # groups whose padded size stays within the token budget
            longest = max([len(r.prompt) for r in group] + [len(request.prompt)])
            if group and longest * (len(group) + 1) > self.prefill_tokens:
                sampled += self._prefill_group(group, version)
                group = []
            group.append(request)
        if group:
            sampled += self._prefill_group(group, version)
        self._sampling = None
        return sampled

    def _prefill_group(self, requests: list[Request], version: int) -> int:
        first_slots: list[int] = []
        sequences: list[Sequence] = []
        for request in requests:
            first_slots.append(len(self.running) + len(sequences))
            for index in range(request.params.n):
                sequence = Sequence(request, index, self.device, self.tokenizer)
                sequence.cache_len = len(request.prompt)
                sequences.append(sequence)
        logits = self._prefill_rows([r.prompt for r in requests], first_slots)
        rows = []
        for i, (request, slot) in enumerate(zip(requests, first_slots, strict=True)):
            for index in range(1, request.params.n):  # n samples share one prefill
                self.cache.copy_slot(slot, slot + index, len(request.prompt))
            rows += [i] * request.params.n
        self.running.extend(sequences)
        logits = logits[torch.tensor(rows, device=self.device)]
        self._sample_into(sequences, logits, self._sampling_for(sequences), version)
        return len(sequences)

    def decode(self, version: int) -> int:
        """One token for every running sequence; returns tokens sampled. With the fixed decode
        shape the forward pass covers every slot: an idle slot's row is token 0 at position 0,
        attending to itself only (its KV lands in the slot's position 0, which the prefill of the
        slot's next sequence overwrites), and its logits are dropped."""
        running = self.running
        device = self.device
        lengths = [s.cache_len for s in running]
        tokens = [s.tokens[-1] for s in running]
        if self.fixed_shape:
            idle = self.max_batch - len(running)
            lengths, tokens = lengths + [0] * idle, tokens + [0] * idle
        positions = torch.tensor(lengths, device=device)
        attend = max(lengths) + 1
        mask = (torch.arange(attend, device=device)[None, :] <= positions[:, None])[:, None, None, :]
        input_ids = torch.tensor(tokens, device=device)[:, None]
        self.cache.prepare_decode(positions, attend)
        logits = self._forward(input_ids, positions[:, None], mask)[: len(running)]
        for s in running:
            s.cache_len += 1
        if self._sampling is None:
            self._sampling = self._sampling_for(running)
        self._sample_into(running, logits, self._sampling, version)
        return len(running)

    def recompute(self) -> None:
        """Rebuild every running sequence's KV under the current weights (kv_policy=recompute):
        slots grouped by length, each group's padded size within `prefill_tokens`."""
        group: list[int] = []
        for i in sorted(range(len(self.running)), key=lambda i: self.running[i].cache_len):
            length = self.running[i].cache_len  # ascending: the newest row is the group's longest
            if group and length * (len(group) + 1) > self.prefill_tokens:
                self._refill(group)
                group = []
            group.append(i)
        if group:
            self._refill(group)

    def _refill(self, slots: list[int]) -> None:
        self._prefill_rows([self.running[i].all_tokens()[: self.running[i].cache_len] for i in slots], slots)

    # -- sampling and bookkeeping ----------------------------------------------------------------
    def _sampling_for(self, sequences: list[Sequence]) -> BatchSampling:
        params = [s.request.params for s in sequences]
        device = self.device
        use_k = any(p.top_k > 0 for p in params)
        use_p = any(p.top_p < 1 for p in params)
        return BatchSampling(
            temperature=torch.tensor([p.temperature for p in params], device=device),
            top_k=torch.tensor([p.top_k for p in params], device=device) if use_k else None,
            top_p=torch.tensor([p.top_p for p in params], device=device) if use_p else None,
            generators=[s.generator for s in sequences],
            any_sampled=any(p.temperature > 0 for p in params),
            top_logprobs=max(p.top_logprobs for p in params),
        )

    def _sample_into(
        self, sequences: list[Sequence], logits: torch.Tensor, sampling: BatchSampling, version: int
    ) -> None:
        drawn = sample(logits, sampling, self.generator)
        tokens = drawn.tokens.tolist()
        logprobs = drawn.logprobs.tolist()
        tops: list[list[tuple[int, float]]] | None = None
        if drawn.top_ids is not None and drawn.top_logprobs is not None:
            tops = [
                list(zip(ids, values, strict=True))
                for ids, values in zip(drawn.top_ids.tolist(), drawn.top_logprobs.tolist(), strict=True)
            ]
        eos, max_len = self.eos_ids, self.max_len
        for i, s in enumerate(sequences):
            top = tops[i][: s.request.params.top_logprobs] if tops is not None else None
            s.append(tokens[i], logprobs[i], version, eos, max_len, top)

    def retire(self) -> list[Sequence]:
        """Remove the finished sequences (returned), keeping the batch compact."""
        running = self.running
        done = [s for s in running if s.finished]
        if not done:
            return done
        keep = len(running) - len(done)
        holes = [i for i in range(keep) if running[i].finished]
        movers = [i for i in range(keep, len(running)) if not running[i].finished]
        if holes:  # move the tail's live sequences (and their KV) into the freed slots
            longest = max(running[m].cache_len for m in movers)
            src = torch.tensor(movers, device=self.device)
            dst = torch.tensor(holes, device=self.device)
            for store in (self.cache.keys, self.cache.values):
                for tensor in store:
                    tensor[dst, :, :longest] = tensor[src, :, :longest]
            for h, m in zip(holes, movers, strict=True):
                running[h] = running[m]
        del running[keep:]
        self._sampling = None
        return done
