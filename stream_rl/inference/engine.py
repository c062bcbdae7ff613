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

Swap policy (`swap_policy`): `in_flight` (default) installs a pending swap at the next step
boundary, running sequences included. `between_sequences` (updates without in-flight semantics)
stops admitting new sequences once a swap is pending, lets the running ones finish on the old
weights, installs the swap when none is running, then resumes admission: every sequence then
carries a single version span, and `stall_ms` measures the whole drain (from the swap request to
the new weights in force), the time admission was held.

`EngineStats.busy_s` is the time spent inside `step()` (the loop sleeps when there is nothing to
do), so `1 - Δbusy_s / Δt` is the engine's idle fraction over any interval.

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
from stream_rl.inference.batch import Batch
from stream_rl.inference.parameters import DTYPES, ParameterTable
from stream_rl.inference.requests import Request, RequestResult, SamplingParams

logger = logging.getLogger(__name__)

KvPolicy = Literal["keep", "recompute"]
SwapPolicy = Literal["in_flight", "between_sequences"]
SWAP_POLICIES: tuple[SwapPolicy, ...] = ("in_flight", "between_sequences")


class EngineStopped(InferenceError):
    """The engine's loop is not running (stopped, or failed): the server answers 503."""


class ContextLengthError(InferenceError):
    """The prompt plus `max_tokens` exceed the engine's maximum sequence length (a 400: the
    request can never fit; vLLM refuses it the same way)."""


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
    busy_s: float
    """Seconds spent in `step()` since the engine was built (decoding, prefilling, swapping)."""
    max_batch: int = 0
    """Sequences the engine decodes together at most (its KV slots)."""
    sequence_s: float = 0.0
    """Integral of the running sequences over time (sequence-seconds): over any interval,
    `Δsequence_s / (Δt · max_batch)` is the mean batch occupancy, idle time counting as empty."""
    kv_cache_bytes: int = 0
    """Bytes of KV cache allocated now (every slot at the current capacity)."""
    kv_cache_max_bytes: int = 0
    """Bytes it grows to when a sequence reaches `max_len` (every slot at full length)."""
    max_len: int = 0
    """Longest sequence (prompt + completion) the engine holds."""


@dataclass
class _Swap:
    version: int
    tensors: dict[str, torch.Tensor]
    future: concurrent.futures.Future[SwapResult]
    requested: float = 0.0
    """`time.perf_counter()` when the swap was requested (start of a between-sequences drain)."""
    ready: Any = None
    """CUDA: an event after which `tensors` hold their bytes (the receive stream's); the decode
    stream waits for it on the GPU before the swap, so the host never blocks on the transfer."""


class Engine:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_batch: int = 64,
        kv_policy: KvPolicy = "keep",
        swap_policy: SwapPolicy = "in_flight",
        seed: int | None = None,
        prefill_tokens: int = 8192,
        version: int = 0,
        admit_batch: int | None = None,
        admit_wait: int = 8,
        decode_shape: str = "running",
    ) -> None:
        config = model.config.get_text_config()
        if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
            raise InferenceError("models with sliding-window or linear-attention layers are not supported")
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.max_batch = max_batch
        self.kv_policy = kv_policy
        if swap_policy not in SWAP_POLICIES:
            raise InferenceError(
                f"swap_policy must be one of {', '.join(SWAP_POLICIES)}, got {swap_policy!r}"
            )
        self.swap_policy = swap_policy
        self.admit_batch = admit_batch or max(1, max_batch // 8)
        self.admit_wait = admit_wait
        self._deferred = 0
        self.max_len = int(getattr(config, "max_position_embeddings", 2048))
        self.version = version
        self.parameters = ParameterTable(model)
        generator = torch.Generator(device=self.device).manual_seed(
            seed if seed is not None else random.SystemRandom().getrandbits(63)
        )
        self.batch = Batch(
            model,
            tokenizer,
            max_batch=max_batch,
            max_len=self.max_len,
            prefill_tokens=prefill_tokens,
            generator=generator,
            decode_shape=decode_shape,
        )
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
        self._busy_s = 0.0
        self._sequence_s = 0.0
        self._rate: collections.deque[tuple[float, int]] = collections.deque()

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        attn_implementation: str = "sdpa",
        **kwargs: Any,
    ) -> Engine:
        """Load a local Hugging Face model directory (no hub access) and build an engine.

        Loaded like the trainer's model (`stream_rl.common.modeling.load_causal_lm`): with bf16/fp16 an
        untied lm_head stays float32, so the parameters match what the trainer pushes."""
        from transformers import AutoTokenizer

        from stream_rl.common.modeling import load_causal_lm
        from stream_rl.errors import ConfigError

        if dtype not in DTYPES:
            raise InferenceError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise InferenceError("--device cuda, but CUDA is not available here")
        if not (Path(path) / "config.json").is_file():
            raise InferenceError(f"{path} is not a model directory (no config.json)")
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        try:
            model = load_causal_lm(path, dtype=dtype, attn_implementation=attn_implementation, device=device)
        except ConfigError as exc:
            raise InferenceError(str(exc)) from exc
        return cls(model, tokenizer, **kwargs)

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
            raise ContextLengthError(
                f"the prompt has {len(prompt)} tokens; the model's maximum is {self.max_len - 1}"
            )
        if len(prompt) + params.max_tokens > self.max_len:
            raise ContextLengthError(
                f"the request needs {len(prompt)} prompt + {params.max_tokens} completion tokens, more "
                f"than the model's maximum length of {self.max_len}: ask for at most "
                f"max_tokens={self.max_len - len(prompt)}, or shorten the prompt"
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
        self, version: int, tensors: dict[str, torch.Tensor], ready: Any = None
    ) -> concurrent.futures.Future[SwapResult]:
        """Install `tensors` (canonical names -> tensors matching the parameters) as `version`
        at the next step boundary. The future resolves once they are in force. `ready`: a CUDA
        event the tensors' writes were recorded before (they may be written on another stream);
        the engine's stream waits for it before the first forward on the new weights."""
        future: concurrent.futures.Future[SwapResult] = concurrent.futures.Future()
        with self._cond:
            if self._swap is not None:
                raise InferenceError("a weight swap is already pending")
            if self._error is not None or self._stopping:
                raise EngineStopped("the engine is not running")
            self._swap = _Swap(version, tensors, future, requested=time.perf_counter(), ready=ready)
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
                running=len(self.batch),
                waiting=sum(r.params.n for r in self._waiting),
                version=self.version,
                generated_tokens=self._generated,
                finished_requests=self._finished,
                steps=self._steps,
                tokens_per_s=rate,
                alive=self.alive,
                busy_s=self._busy_s,
                max_batch=self.max_batch,
                sequence_s=self._sequence_s,
                kv_cache_bytes=self.batch.cache.allocated_bytes(),
                kv_cache_max_bytes=self.batch.cache.allocated_bytes(self.max_len),
                max_len=self.max_len,
            )

    # -- the loop (engine thread) -----------------------------------------------------------------
    def _loop(self) -> None:
        try:
            with torch.inference_mode():
                while True:
                    with self._cond:
                        while not (self._stopping or self._waiting or self.batch.running or self._swap):
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
        started = time.perf_counter()
        self._install_swap()
        self._admit()
        self._retire()  # sequences done after their first token (eos, max_tokens=1)
        decoded = 0
        if self.batch.running:
            decoded = self.batch.decode(self.version)
            self._generated += decoded
            self._retire()
        self._steps += 1
        now = time.monotonic()
        with self._cond:
            elapsed = time.perf_counter() - started
            self._busy_s += elapsed
            self._sequence_s += decoded * elapsed
            self._rate.append((now, self._generated))
            while now - self._rate[0][0] > 5.0:
                self._rate.popleft()

    def _fail_all(self, error: InferenceError) -> None:
        with self._cond:
            pending = list(self._unresolved)
            self._unresolved.clear()
            self._waiting.clear()
            self.batch.running = []
            swap, self._swap = self._swap, None
        for request in pending:
            if not request.future.done():
                request.future.set_exception(error)
        if swap is not None and not swap.future.done():
            swap.future.set_exception(error)

    def _draining(self) -> bool:
        """A swap waits for the running sequences to finish (between_sequences): admit nothing."""
        return self._swap is not None and self.swap_policy == "between_sequences"

    def _install_swap(self) -> None:
        with self._cond:
            if self._draining() and self.batch.running:
                return  # the running sequences finish on the old weights first
            swap, self._swap = self._swap, None
        if swap is None:
            return
        start = swap.requested if self.swap_policy == "between_sequences" else time.perf_counter()
        if swap.ready is not None:  # a GPU-side wait: the kernels queued from here on wait for it
            torch.cuda.current_stream(self.device).wait_event(swap.ready)
        replaced = self.parameters.install(swap.tensors)
        if self.kv_policy == "recompute" and self.batch.running:
            self.batch.recompute()
        self.version = swap.version
        stall_ms = (time.perf_counter() - start) * 1000
        swap.future.set_result(SwapResult(swap.version, stall_ms, replaced))

    def _admit(self) -> None:
        admitted: list[Request] = []
        free = self.max_batch - len(self.batch)
        with self._cond:
            if self._draining() or not self._waiting or self._waiting[0].params.n > free:
                return
            # Each prefill is a forward pass of its own (~1 ms of fixed overhead on CPU), so while
            # others decode, wait for a few free slots rather than prefilling one prompt per step;
            # a waiting request is never held back more than `admit_wait` steps.
            if self.batch.running and free < self.admit_batch and self._deferred < self.admit_wait:
                self._deferred += 1
                return
            self._deferred = 0
            while self._waiting and self._waiting[0].params.n <= free:
                request = self._waiting.popleft()
                free -= request.params.n
                admitted.append(request)
        self._generated += self.batch.prefill(admitted, self.version)

    def _retire(self) -> None:
        for s in self.batch.retire():
            if s.request.finish_sequence(s.result()):
                self._finished += 1
                with self._cond:
                    self._unresolved.discard(s.request)
