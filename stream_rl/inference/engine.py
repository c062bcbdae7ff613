"""The built-in inference engine: continuous batching over a transformers causal LM (CPU or CUDA).

One thread runs the decode loop; callers `submit()` requests from any thread and get a
`concurrent.futures.Future`. Every iteration of the loop:
  1. installs a pending weight swap, if any (pointer swap of parameter data; with
     `kv_policy="recompute"` the running sequences' KV caches are recomputed under the new
     weights). `stall_ms` is how long this paused decoding. Tokens sampled from then on carry
     the new version in their version spans;
  2. admits waiting requests while slots are free (up to `max_batch` sequences): one prefill
     forward per group of prompts, which also samples each sequence's first token. A request
     with n > 1 is prefilled once and its KV copied to its n slots. While others decode,
     admission waits for `admit_batch` free slots (default max_batch / 8), at most `admit_wait`
     steps: each prefill is a forward pass with its own fixed cost;
  3. one batched decode forward for all running sequences, one token each;
  4. retires finished sequences (eos, stop string, max_tokens, model length) and resolves
     requests whose n sequences are all done.
Running sequences keep their slot's KV cache across a swap under the default `kv_policy="keep"`
(PipelineRL's in-flight semantics). Sampling semantics: sampling.py; result semantics: sequence.py.

Use alone: `Engine.load("models/tiny").generate([[4, 9, 13]], SamplingParams(max_tokens=8))`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from stream_rl.errors import InferenceError
from stream_rl.inference.kv import SlotCache
from stream_rl.inference.parameters import DTYPES, ParameterTable
from stream_rl.inference.sampling import BatchSampling, sample
from stream_rl.inference.sequence import Request, RequestResult, SamplingParams, Sequence

logger = logging.getLogger(__name__)

KvPolicy = Literal["keep", "recompute"]


class EngineStopped(InferenceError):
    """The engine's loop is not running (stopped, or failed): the server answers 503."""


@dataclass(frozen=True)
class SwapResult:
    version: int
    stall_ms: float
    replaced: dict[str, torch.Tensor]  # the tensors swapped out (reusable as shadow buffers)


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    version: int
    generated_tokens: int
    finished_requests: int
    steps: int
    tokens_per_s: float
    alive: bool


@dataclass
class _Swap:
    version: int
    tensors: dict[str, torch.Tensor]
    future: concurrent.futures.Future[SwapResult]


class Engine:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_batch: int = 64,
        kv_policy: KvPolicy = "keep",
        seed: int | None = None,
        prefill_tokens: int = 8192,
        version: int = 0,
        admit_batch: int | None = None,
        admit_wait: int = 8,
    ) -> None:
        config = model.config.get_text_config()
        if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
            raise InferenceError("models with sliding-window or linear-attention layers are not supported")
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.max_batch = max_batch
        self.kv_policy = kv_policy
        self.prefill_tokens = prefill_tokens
        self.admit_batch = admit_batch or max(1, max_batch // 8)
        self.admit_wait = admit_wait
        self._deferred = 0
        self.max_len = int(getattr(config, "max_position_embeddings", 2048))
        self.version = version
        self.parameters = ParameterTable(model)
        self.eos_ids = self._eos_ids(model, tokenizer)
        heads = config.num_attention_heads
        self.cache = SlotCache(
            num_layers=config.num_hidden_layers,
            slots=max_batch,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            max_len=self.max_len,
            dtype=next(model.parameters()).dtype,
            device=self.device,
        )
        self._shared = torch.Generator(device=self.device).manual_seed(
            seed if seed is not None else random.SystemRandom().getrandbits(63)
        )
        self._running: list[Sequence] = []
        self._batch: BatchSampling | None = None  # rebuilt when the running set changes
        self._waiting: collections.deque[Request] = collections.deque()
        self._unresolved: set[Request] = set()  # submitted, future not yet resolved
        self._swap: _Swap | None = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._error: BaseException | None = None
        self._generated = 0
        self._finished = 0
        self._steps = 0
        self._rate: collections.deque[tuple[float, int]] = collections.deque()

    @classmethod
    def load(cls, path: str | Path, *, device: str = "cpu", dtype: str = "float32", **kwargs: Any) -> Engine:
        """Load a local Hugging Face model directory (no hub access) and build an engine."""
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        if dtype not in DTYPES:
            raise InferenceError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if not (Path(path) / "config.json").is_file():
            raise InferenceError(f"{path} is not a model directory (no config.json)")
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model: Any = AutoModelForCausalLM.from_pretrained(
            path, dtype=DTYPES[dtype], attn_implementation="sdpa", local_files_only=True
        )
        model.to(torch.device(device))
        return cls(model, tokenizer, **kwargs)

    @staticmethod
    def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
        ids: set[int] = set()
        generation = getattr(model, "generation_config", None)
        eos = getattr(generation, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else (eos or []))
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        return frozenset(ids)

    # -- public API (any thread) -----------------------------------------------------------------
    def start(self) -> Engine:
        """Start the decode loop thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the loop; unfinished requests fail with InferenceError."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._fail_all(EngineStopped("engine stopped"))

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    def submit(self, prompt: list[int], params: SamplingParams) -> concurrent.futures.Future[RequestResult]:
        """Queue a request; the future resolves to its RequestResult (or InferenceError)."""
        params.validate()
        if not prompt:
            raise InferenceError("the prompt is empty")
        if params.n > self.max_batch:
            raise InferenceError(f"n={params.n} exceeds the server's max batch ({self.max_batch})")
        if len(prompt) >= self.max_len:
            raise InferenceError(
                f"the prompt has {len(prompt)} tokens; the model's maximum is {self.max_len - 1}"
            )
        vocab = self.model.get_input_embeddings().num_embeddings
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise InferenceError(f"prompt token ids must be in [0, {vocab})")
        future: concurrent.futures.Future[RequestResult] = concurrent.futures.Future()
        request = Request(list(prompt), params, future, results=[None] * params.n)
        with self._cond:
            if self._error is not None or self._stopping:
                raise EngineStopped("the engine is not running")
            self._waiting.append(request)
            self._unresolved.add(request)
            self._cond.notify_all()
        return future

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[RequestResult]:
        """Submit every prompt and wait (starts the loop if needed). Convenient for scripts."""
        self.start()
        futures = [self.submit(p, params) for p in prompts]
        return [f.result() for f in futures]

    def swap_weights(
        self, version: int, tensors: dict[str, torch.Tensor]
    ) -> concurrent.futures.Future[SwapResult]:
        """Install `tensors` (canonical names -> tensors matching the parameters) as `version`
        at the next step boundary. The future resolves once they are in force."""
        future: concurrent.futures.Future[SwapResult] = concurrent.futures.Future()
        with self._cond:
            if self._swap is not None:
                raise InferenceError("a weight swap is already pending")
            if self._error is not None or self._stopping:
                raise EngineStopped("the engine is not running")
            self._swap = _Swap(version, tensors, future)
            self._cond.notify_all()
        return future

    def stats(self) -> EngineStats:
        with self._cond:
            now = time.monotonic()
            rate = 0.0
            if len(self._rate) >= 2 and now - self._rate[-1][0] < 2.0:
                (t0, n0), (t1, n1) = self._rate[0], self._rate[-1]
                rate = (n1 - n0) / max(t1 - t0, 1e-9)
            return EngineStats(
                running=len(self._running),
                waiting=sum(r.params.n for r in self._waiting),
                version=self.version,
                generated_tokens=self._generated,
                finished_requests=self._finished,
                steps=self._steps,
                tokens_per_s=rate,
                alive=self.alive,
            )

    # -- the loop (engine thread) -----------------------------------------------------------------
    def _loop(self) -> None:
        try:
            with torch.inference_mode():
                while True:
                    with self._cond:
                        while not (self._stopping or self._waiting or self._running or self._swap):
                            self._cond.wait()
                        if self._stopping:
                            return
                    self.step()
        except Exception as exc:
            # The loop must not die silently: log the traceback, fail every caller, mark the
            # engine dead (health 503) and end the thread.
            logger.exception("engine loop failed")
            self._error = exc
            self._fail_all(EngineStopped(f"engine failure: {exc}"))

    def step(self) -> None:
        """One iteration: swap, admit, decode, retire (call from one thread only)."""
        self._install_swap()
        self._admit()
        self._retire()  # sequences done after their first token (eos, max_tokens=1)
        if self._running:
            self._decode()
            self._retire()
        self._steps += 1
        now = time.monotonic()
        self._rate.append((now, self._generated))
        while now - self._rate[0][0] > 5.0:
            self._rate.popleft()

    def _fail_all(self, error: InferenceError) -> None:
        with self._cond:
            pending = list(self._unresolved)
            self._unresolved.clear()
            self._waiting.clear()
            self._running = []
            swap, self._swap = self._swap, None
        for request in pending:
            if not request.future.done():
                request.future.set_exception(error)
        if swap is not None and not swap.future.done():
            swap.future.set_exception(error)

    def _install_swap(self) -> None:
        with self._cond:
            swap, self._swap = self._swap, None
        if swap is None:
            return
        start = time.perf_counter()
        replaced = self.parameters.install(swap.tensors)
        if self.kv_policy == "recompute" and self._running:
            self._recompute_cache()
        self.version = swap.version
        stall_ms = (time.perf_counter() - start) * 1000
        swap.future.set_result(SwapResult(swap.version, stall_ms, replaced))

    def _admit(self) -> None:
        admitted: list[Request] = []
        free = self.max_batch - len(self._running)
        with self._cond:
            if not self._waiting or self._waiting[0].params.n > free:
                return
            # Each prefill is a forward pass of its own (~1 ms of fixed overhead on CPU), so while
            # others decode, wait for a few free slots rather than prefilling one prompt per step;
            # a waiting request is never held back more than `admit_wait` steps.
            if self._running and free < self.admit_batch and self._deferred < self.admit_wait:
                self._deferred += 1
                return
            self._deferred = 0
            while self._waiting and self._waiting[0].params.n <= free:
                request = self._waiting.popleft()
                free -= request.params.n
                admitted.append(request)
        if not admitted:
            return
        # Prefill in groups whose padded size stays within the token budget.
        group: list[Request] = []
        for request in admitted:
            longest = max([len(r.prompt) for r in group] + [len(request.prompt)])
            if group and longest * (len(group) + 1) > self.prefill_tokens:
                self._prefill(group)
                group = []
            group.append(request)
        self._prefill(group)
        self._batch = None

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, **kw: Any
    ) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
            **kw,
        )
        return out.logits[:, -1]

    def _prefill_rows(self, rows: list[list[int]], slots: list[int]) -> torch.Tensor:
        """Run prompts (right-padded) through the model into `slots`; logits at each last token."""
        device = self.device
        length = max(len(r) for r in rows)
        ids = torch.zeros((len(rows), length), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
        last = torch.tensor([[len(r) - 1] for r in rows], device=device)
        causal = torch.ones((length, length), dtype=torch.bool, device=device).tril()[None, None]
        self.cache.prepare_prefill(torch.tensor(slots, device=device), length)
        positions = torch.arange(length, device=device)[None].expand(len(rows), length)
        return self._forward(ids.to(device), positions, causal, logits_to_keep=last)

    def _prefill(self, requests: list[Request]) -> None:
        first_slots: list[int] = []
        sequences: list[Sequence] = []
        for request in requests:
            first_slots.append(len(self._running) + len(sequences))
            for index in range(request.params.n):
                sequence = Sequence(request, index, self.device, self.tokenizer)
                sequence.cache_len = len(request.prompt)
                sequences.append(sequence)
        logits = self._prefill_rows([r.prompt for r in requests], first_slots)
        rows = []
        for i, (request, slot) in enumerate(zip(requests, first_slots, strict=True)):
            for index in range(1, request.params.n):
                self.cache.copy_slot(slot, slot + index, len(request.prompt))
            rows += [i] * request.params.n
        self._running.extend(sequences)
        logits = logits[torch.tensor(rows, device=self.device)]
        self._sample_into(sequences, logits, self._sampling_for(sequences))

    def _decode(self) -> None:
        running = self._running
        device = self.device
        positions = torch.tensor([s.cache_len for s in running], device=device)
        attend = max(s.cache_len for s in running) + 1
        mask = (torch.arange(attend, device=device)[None, :] <= positions[:, None])[:, None, None, :]
        input_ids = torch.tensor([[s.tokens[-1]] for s in running], device=device)
        self.cache.prepare_decode(positions, attend)
        logits = self._forward(input_ids, positions[:, None], mask)
        for s in running:
            s.cache_len += 1
        if self._batch is None:
            self._batch = self._sampling_for(running)
        self._sample_into(running, logits, self._batch)

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

    def _sample_into(self, sequences: list[Sequence], logits: torch.Tensor, batch: BatchSampling) -> None:
        drawn = sample(logits, batch, self._shared)
        tokens = drawn.tokens.tolist()
        logprobs = drawn.logprobs.tolist()
        tops: list[list[tuple[int, float]]] | None = None
        if drawn.top_ids is not None and drawn.top_logprobs is not None:
            tops = [
                list(zip(ids, values, strict=True))
                for ids, values in zip(drawn.top_ids.tolist(), drawn.top_logprobs.tolist(), strict=True)
            ]
        version, eos, max_len = self.version, self.eos_ids, self.max_len
        for i, s in enumerate(sequences):
            if s.finished:  # sampled alongside the batch, but already done
                continue
            top = tops[i][: s.request.params.top_logprobs] if tops is not None else None
            s.append(tokens[i], logprobs[i], version, eos, max_len, top)
        self._generated += len(sequences)

    def _retire(self) -> None:
        running = self._running
        done = [s for s in running if s.finished]
        if not done:
            return
        keep = len(running) - len(done)
        holes = [i for i in range(keep) if running[i].finished]
        movers = [i for i in range(keep, len(running)) if not running[i].finished]
        if holes:
            # Keep the batch compact: move the tail's live sequences into the freed slots.
            longest = max(running[m].cache_len for m in movers)
            src = torch.tensor(movers, device=self.device)
            dst = torch.tensor(holes, device=self.device)
            for store in (self.cache.keys, self.cache.values):
                for tensor in store:
                    tensor[dst, :, :longest] = tensor[src, :, :longest]
            for h, m in zip(holes, movers, strict=True):
                running[h] = running[m]
        with self._cond:
            del running[keep:]
        self._batch = None
        for s in done:
            if s.request.finish_sequence(s.result()):
                self._finished += 1
                with self._cond:
                    self._unresolved.discard(s.request)

    def _recompute_cache(self) -> None:
        """Rebuild every running sequence's KV under the current weights (kv_policy=recompute)."""
        group: list[int] = []
        for i in range(len(self._running)):
            group.append(i)
            if sum(self._running[j].cache_len for j in group) >= self.prefill_tokens:
                self._refill(group)
                group = []
        if group:
            self._refill(group)

    def _refill(self, slots: list[int]) -> None:
        rows = [self._running[i].all_tokens()[: self._running[i].cache_len] for i in slots]
        self._prefill_rows(rows, slots)
