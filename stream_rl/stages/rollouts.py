"""Turning inference results into `Rollout` records, and the `ModelClient` multi-turn tasks drive.

- Single-turn: the actor sends the problem's chat messages to a server (the server applies the
  chat template and returns the prompt's token ids); one completion becomes one rollout whose
  completion is every sampled token (end of sequence included), with the server's behaviour
  logprobs and version spans, and `completion_mask` None (every token sampled).
- Multi-turn: `Task.generate_rollout(TurnClient(...), problem, sampling)` drives one server
  through several calls and returns ONE sequence; its `text` (which carries the environment's
  game-over marker) becomes `Rollout.text`, its mask marks the sampled tokens.
- Sampling seeds: `sample_seed(run_seed, rollout_id)` is stable, so re-generating a rollout
  after a crash asks the server for the same random stream (same tokens under same weights).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from stream_rl.config import SamplingConfig
from stream_rl.contracts import ChatMessage, Problem, Rollout, now_ms
from stream_rl.errors import InferenceError, TaskError
from stream_rl.inference.completion import Completion
from stream_rl.tasks.base import Task

if TYPE_CHECKING:
    from stream_rl.inference.builtin_client import CompletionClient

_TURN_STRIDE = 7919


def sample_seed(run_seed: int, rollout_id: str) -> int:
    """A stable 31-bit sampling seed per rollout."""
    return zlib.crc32(f"{run_seed}:{rollout_id}".encode()) & 0x7FFFFFFF


def build_rollout(
    problem: Problem,
    sample_index: int,
    group_size: int,
    completion: Completion,
    *,
    actor_id: str,
    server_id: str,
    started_ms: int,
    finished_ms: int,
    generation_ms: float,
    completion_mask: list[bool] | None = None,
    num_turns: int = 1,
) -> Rollout:
    """The `Rollout` of one sample: a single-turn completion (`completion_mask` None: every token
    sampled), or a multi-turn sequence (`MultiTurnResult.completion()` with its mask and turns)."""
    group_id = Rollout.make_group_id(problem)
    return Rollout(
        rollout_id=Rollout.make_rollout_id(group_id, sample_index),
        group_id=group_id,
        sample_index=sample_index,
        group_size=group_size,
        problem=problem,
        prompt_token_ids=list(completion.prompt_token_ids),
        completion_token_ids=list(completion.token_ids),
        completion_mask=completion_mask,
        logprobs=list(completion.logprobs),
        version_spans=list(completion.version_spans),
        finish_reason=completion.finish_reason,
        text=completion.text,
        num_turns=num_turns,
        actor_id=actor_id,
        server_id=server_id,
        started_ms=started_ms,
        finished_ms=finished_ms,
        generation_ms=generation_ms,
    )


class Sampler:
    """Samples of a problem on one server, as validated `Rollout`s (a ContractError is the
    server's: the pool retries): a whole single-turn group in one request (`sample_group`), or
    one multi-turn rollout (`sample_conversation`)."""

    def __init__(
        self, task: Task, tokenizer: Tokenizer | None, sampling: SamplingConfig, actor_id: str
    ) -> None:
        self.task = task
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.actor_id = actor_id

    async def sample_conversation(
        self,
        client: CompletionClient,
        server_id: str,
        problem: Problem,
        index: int,
        group_size: int,
        seed: int | None,
    ) -> Rollout:
        """Sample `index` of a multi-turn problem: the task drives the conversation."""
        if self.tokenizer is None:
            raise TaskError(f"task {self.task.name!r} is multi-turn: the actor needs the model's tokenizer")
        started, t0 = now_ms(), time.perf_counter()
        turns = TurnClient(client, self.tokenizer, seed)
        result = await self.task.generate_rollout(turns, problem, self.sampling)
        rollout = build_rollout(
            problem,
            index,
            group_size,
            result.completion(),
            actor_id=self.actor_id,
            server_id=server_id,
            started_ms=started,
            finished_ms=now_ms(),
            generation_ms=(time.perf_counter() - t0) * 1000,
            completion_mask=list(result.completion_mask),
            num_turns=result.num_turns,
        )
        rollout.validate()
        return rollout

    async def sample_group(
        self, client: CompletionClient, server_id: str, problem: Problem, group_size: int, seed: int | None
    ) -> list[Rollout]:
        """All `group_size` samples of a single-turn problem in ONE request (`n = group_size`):
        one HTTP round trip, one chat-template render and one prefill instead of `group_size`."""
        started, t0 = now_ms(), time.perf_counter()
        messages = [m.to_dict() for m in problem.prompt]
        completions = await client.complete_many(messages, self.sampling, n=group_size, seed=seed)
        if len(completions) != group_size:
            raise InferenceError(f"{server_id} returned {len(completions)} choices for n={group_size}")
        finished, generation_ms = now_ms(), (time.perf_counter() - t0) * 1000
        rollouts = []
        for index, completion in enumerate(completions):
            rollout = build_rollout(
                problem,
                index,
                group_size,
                completion,
                actor_id=self.actor_id,
                server_id=server_id,
                started_ms=started,
                finished_ms=finished,
                generation_ms=generation_ms,
            )
            rollout.validate()
            rollouts.append(rollout)
        return rollouts


class Tokenizer(Protocol):
    """What a multi-turn rollout needs of the model's tokenizer: `ChatTokenizer`, or a test's."""

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class ChatTokenizer:
    """`render`/`decode` with the model's own tokenizer and chat template (multi-turn tasks only;
    transformers is imported on first use)."""

    def __init__(self, model_path: str) -> None:
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        except OSError as exc:
            raise TaskError(f"cannot load the tokenizer of model.path={model_path!r}: {exc}") from exc

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        out: Any = self._tok.apply_chat_template(
            [m.to_dict() for m in messages], add_generation_prompt=add_generation_prompt, tokenize=True
        )
        if isinstance(out, Mapping):  # transformers 5 may return a BatchEncoding
            out = out["input_ids"]
        return [int(t) for t in out]

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tok.decode(token_ids, skip_special_tokens=True))


class TurnClient:
    """A `ModelClient` bound to ONE server's client for the whole multi-turn rollout."""

    def __init__(self, client: CompletionClient, tokenizer: Tokenizer, seed: int | None) -> None:
        """`tokenizer`: `render(messages, add_generation_prompt=True)` and `decode(ids)`, e.g. a
        `ChatTokenizer`."""
        self._client = client
        self._tokenizer = tokenizer
        self._seed = seed
        self._turn = 0

    async def complete(self, prompt_token_ids: list[int], sampling: SamplingConfig) -> Completion:
        seed = None if self._seed is None else (self._seed + _TURN_STRIDE * self._turn) & 0x7FFFFFFF
        self._turn += 1
        return await self._client.complete(prompt_token_ids, sampling, seed=seed)

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        return self._tokenizer.render(messages, add_generation_prompt=add_generation_prompt)

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids)
