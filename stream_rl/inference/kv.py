"""The engine's KV cache: one preallocated slot per running sequence, shared by all of them.

Layout per layer: keys and values of shape `[slots, kv_heads, capacity, head_dim]`. Sequence i
of the running batch lives in slot i (the batch is kept compact: when a sequence leaves, the
last one moves into its slot), its position p in `[i, :, p]`. A decode step writes each row's
new key at that row's own position and attends over `[:batch, :, :max_len]` with a per-row
length mask, so sequences of different lengths decode together without copying the cache.
Capacity grows by doubling (one copy) up to the model's maximum length; every slot has the same
capacity, so memory is `slots x capacity` positions (`allocated_bytes()`: at most
`slots x max_len`, which the server logs at start and exports as a gauge).

A prompt longer than the prefill budget is written in chunks (`prepare_extend()`): each chunk's
keys go to their positions and its queries attend to the slot's positions so far, so attention
memory stays `chunk x length` instead of `length x length`.

It plugs into any transformers model whose attention layers call `cache.update(k, v, layer_idx)`
(the standard decoder-only models of transformers 5): set `prepare_prefill()` or
`prepare_decode()` before each forward.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache


class SlotCache(Cache):
    """Per-slot KV storage with two forward modes (prefill a group of slots, decode a batch)."""

    def __init__(
        self,
        *,
        num_layers: int,
        slots: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        initial_capacity: int = 256,
    ) -> None:
        super().__init__(layers=[])
        self.num_layers = num_layers
        self.max_len = max_len
        self.capacity = min(initial_capacity, max_len)
        shape = (slots, kv_heads, self.capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._mode = ""
        self._slots: torch.Tensor | None = None
        self._rows: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._attend_len = 0
        self._start = 0
        self._dims = (num_layers, slots, kv_heads, head_dim, torch.finfo(dtype).bits // 8)

    def allocated_bytes(self, capacity: int | None = None) -> int:
        """Bytes of keys and values at `capacity` positions per slot (default: the current one)."""
        layers, slots, heads, dim, size = self._dims
        return 2 * layers * slots * heads * (capacity or self.capacity) * dim * size

    # -- modes -------------------------------------------------------------------------------
    def prepare_prefill(self, slots: torch.Tensor, length: int) -> None:
        """Next forward: prompts (right-padded to `length`) written to positions 0.. of `slots`."""
        self.ensure_capacity(length)
        self._mode, self._slots = "prefill", slots

    def prepare_extend(self, slot: int, start: int, length: int) -> None:
        """Next forward: `length` tokens of one slot written at positions `start..`; queries attend
        to positions `[0, start + length)` (the caller's mask makes it causal)."""
        self.ensure_capacity(start + length)
        self._mode, self._slots, self._start = "extend", torch.tensor([slot]), start
        self._attend_len = start + length

    def prepare_decode(self, positions: torch.Tensor, attend_len: int) -> None:
        """Next forward: one token per row of slots 0..B-1, written at `positions[row]`;
        attention reads positions `[0, attend_len)` of every row (mask the rest)."""
        self.ensure_capacity(attend_len)
        batch = positions.shape[0]
        if self._rows is None or self._rows.shape[0] != batch:
            self._rows = torch.arange(batch, device=positions.device)
        self._mode, self._positions, self._attend_len = "decode", positions, attend_len

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self._mode == "decode":
            assert self._positions is not None and self._rows is not None
            keys[self._rows, :, self._positions] = key_states[:, :, 0]
            values[self._rows, :, self._positions] = value_states[:, :, 0]
            batch = key_states.shape[0]
            return keys[:batch, :, : self._attend_len], values[:batch, :, : self._attend_len]
        if self._mode == "extend":
            assert self._slots is not None
            slot, end = int(self._slots[0]), self._attend_len
            keys[slot : slot + 1, :, self._start : end] = key_states
            values[slot : slot + 1, :, self._start : end] = value_states
            return keys[slot : slot + 1, :, :end], values[slot : slot + 1, :, :end]
        if self._mode == "prefill":
            # Causal attention over the prompt itself; store it (padding too: it sits beyond
            # each sequence's length and is overwritten as the sequence grows).
            assert self._slots is not None
            length = key_states.shape[2]
            keys[self._slots, :, :length] = key_states
            values[self._slots, :, :length] = value_states
            return key_states, value_states
        raise RuntimeError("SlotCache used without prepare_prefill() or prepare_decode()")

    # -- slot management ---------------------------------------------------------------------
    def ensure_capacity(self, length: int) -> None:
        """Grow (double) the per-slot capacity to hold `length` positions."""
        if length <= self.capacity:
            return
        new_capacity = self.capacity
        while new_capacity < length:
            new_capacity *= 2
        new_capacity = min(max(new_capacity, length), self.max_len)
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                grown = old.new_zeros((*old.shape[:2], new_capacity, old.shape[3]))
                grown[:, :, : self.capacity] = old
                store[i] = grown
        self.capacity = new_capacity

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot `dst`."""
        if src == dst or length == 0:
            return
        for store in (self.keys, self.values):
            for tensor in store:
                tensor[dst, :, :length] = tensor[src, :, :length]

    # -- Cache interface bits transformers may query ------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._attend_len

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_len

    def __len__(self) -> int:
        return self.num_layers
