"""The task interface and registry.

A task turns its configuration (`task.params` in the run config, validated by the task's own
pydantic model with unknown keys forbidden) into:
- `load_problems(run_id, seed) -> list[Problem]`: every problem at epoch 0 (the loader stage
  sets epochs). `problem_id`s are unique within the list and stable across calls: derived from
  the content or the position in the source, never drawn at random per call.
- `load_eval_problems(run_id, seed) -> list[Problem]`: the held-out split (named `eval_split`),
  disjoint from `load_problems`' problems (no id and no prompt in common), with stable ids; the
  evaluator stage samples it. Every built-in task has one.
- `score(problem, completion, *, finish_reason="stop") -> Scored`: the verdict and the reward of
  one completion (its text without the end-of-sequence token). The reward function belongs to
  the task (default 1.0 for `correct`, else 0.0). Scoring is deterministic and runs in
  worker processes: a `Task` pickles (module-level classes, pydantic params), and so do its
  bound `score` and the module-level scoring functions it calls.
- `reward(verdict, finish_reason) -> float`: the reward for a verdict; the verifier uses it for
  the verdicts it produces itself (`error`, `timeout`).
- `generate_rollout(client, problem, sampling) -> MultiTurnResult` for multi-turn tasks
  (`multi_turn = True`): the task drives the model through `ModelClient` and builds one token
  sequence with `stream_rl.tasks.sequence.TurnSequence` (sampled tokens kept as sampled,
  environment tokens from renders of the text conversation).

Register a task class with `@register_task`; build one with `get_task(name, params,
system_prompt)`. Bad params raise `ConfigError` naming `task.params.<key>`; an unknown name
raises `ConfigError` naming `task.name` and the registered tasks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from stream_rl.config import SamplingConfig
from stream_rl.contracts import ChatMessage, Problem, Verdict, VersionSpan
from stream_rl.errors import ConfigError, TaskError
from stream_rl.inference.completion import Completion

FINISH_LENGTH = "length"
"""The finish reason of a completion cut at max_tokens (overlong)."""


@dataclass(frozen=True, slots=True)
class WarmStartDefaults:
    """A task's defaults for `make-model --warm-start` (stream_rl/tools/warm_start.py); the command's
    flags override them. Measured per task: the sampled accuracy RL starts from depends on them."""

    steps: int = 800
    """Supervised steps."""
    batch_tokens: int = 0
    """Tokens per step, examples packed into rows (0: `batch_size` examples, padded)."""
    batch_size: int = 64
    """Examples per step when `batch_tokens` is 0."""
    lr: float = 1e-3
    """AdamW learning rate."""
    label_smoothing: float = 0.35
    """Probability share spread over the vocabulary: the higher, the noisier sampling."""
    min_lr_ratio: float = 1.0
    """The learning rate decays along a cosine to this share of `lr` (1.0: constant)."""


@dataclass(frozen=True, slots=True)
class Scored:
    """The outcome of scoring one completion."""

    verdict: Verdict
    reward: float
    detail: str = ""


class TaskParams(BaseModel):
    """Base of every task's params model: unknown keys are errors, defaults are validated."""

    model_config = ConfigDict(
        extra="forbid", validate_default=True, use_attribute_docstrings=True, frozen=True
    )


@dataclass(slots=True)
class MultiTurnResult:
    """A multi-turn rollout as ONE sequence: prompt, then model and environment tokens interleaved."""

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_mask: list[bool]
    """True for tokens the model sampled (trainable), False for environment tokens."""
    logprobs: list[float]
    """Behaviour logprobs; 0.0 on environment tokens."""
    version_spans: list[VersionSpan]
    """Over the whole completion; environment tokens take the version of the span before them."""
    text: str
    """The decoded completion (model and environment turns)."""
    finish_reason: str
    """The finish reason of the last model call."""
    num_turns: int
    """Model calls made."""
    scored: Scored
    """The environment's verdict and reward (the same `score(problem, text)` gives)."""
    turn_texts: list[str] = field(default_factory=list)
    """Each model call's text, for logs and tests."""

    def completion(self) -> Completion:
        """The whole sequence as one `Completion` (what the rollout is built from)."""
        return Completion(
            prompt_token_ids=self.prompt_token_ids,
            token_ids=self.completion_token_ids,
            logprobs=self.logprobs,
            version_spans=self.version_spans,
            text=self.text,
            finish_reason=self.finish_reason,
        )


class ModelClient(Protocol):
    """What a multi-turn task needs from the actor's inference client.

    Version spans only make sense if the versions of successive calls never decrease: a client
    used for one multi-turn rollout must keep talking to one server.
    """

    async def complete(self, prompt_token_ids: list[int], sampling: SamplingConfig) -> Completion: ...

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the chat template applied to `messages` (their text), followed by the
        generation prompt (e.g. `<|assistant|>`) unless `add_generation_prompt` is False."""
        ...

    def decode(self, token_ids: list[int]) -> str: ...


class Task:
    """Base class of registered tasks; subclasses set `name` and `Params` and implement the rest."""

    name: ClassVar[str]
    Params: ClassVar[type[TaskParams]] = TaskParams
    multi_turn: ClassVar[bool] = False
    warm_start: ClassVar[WarmStartDefaults] = WarmStartDefaults()

    def __init__(self, params: TaskParams, system_prompt: str | None = None) -> None:
        self.params = params
        self.system_prompt = system_prompt

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.params!r})"

    def load_problems(self, run_id: str, seed: int) -> list[Problem]:
        raise NotImplementedError

    @property
    def eval_split(self) -> str:
        """The name of the held-out split (EvalResult.split)."""
        return "held-out"

    def load_eval_problems(self, run_id: str, seed: int) -> list[Problem]:
        raise TaskError(f"task {self.name!r} has no held-out split to evaluate on")

    def score(self, problem: Problem, completion: str, *, finish_reason: str = "stop") -> Scored:
        raise NotImplementedError

    def reward(self, verdict: Verdict, finish_reason: str = "stop") -> float:
        """Default reward: 1.0 for `correct`, else 0.0."""
        return 1.0 if verdict is Verdict.CORRECT else 0.0

    async def generate_rollout(
        self, client: ModelClient, problem: Problem, sampling: SamplingConfig
    ) -> MultiTurnResult:
        raise TaskError(f"task {self.name!r} is single-turn: the actor samples it directly")

    # Helpers for subclasses.
    def make_prompt(self, user_content: str) -> list[ChatMessage]:
        """The optional system message, then one user message."""
        messages = [ChatMessage("system", self.system_prompt)] if self.system_prompt else []
        messages.append(ChatMessage("user", user_content))
        return messages

    def make_problem(
        self, run_id: str, problem_id: str, user_content: str, answer: str | None, metadata: dict[str, str]
    ) -> Problem:
        return Problem(
            run_id=run_id,
            problem_id=problem_id,
            epoch=0,
            task=self.name,
            prompt=self.make_prompt(user_content),
            answer=answer,
            metadata=metadata,
        )


TASKS: dict[str, type[Task]] = {}
"""The registry: task name -> task class (filled by `@register_task` on import)."""

T = TypeVar("T", bound=type[Task])


def register_task(name: str) -> Callable[[T], T]:
    """Class decorator: register a `Task` subclass under `name` (names are unique)."""

    def decorate(cls: T) -> T:
        if name in TASKS and TASKS[name] is not cls:
            raise TaskError(
                f"task {name!r} is registered twice ({TASKS[name].__qualname__}, {cls.__qualname__})"
            )
        cls.name = name
        TASKS[name] = cls
        return cls

    return decorate


def get_task(name: str, params: dict[str, Any] | None = None, system_prompt: str | None = None) -> Task:
    """Build the registered task `name` with validated `params`.

    The built-in tasks are registered by then: importing this module runs `stream_rl.tasks`.
    """
    cls = TASKS.get(name)
    if cls is None:
        raise ConfigError(f"task.name: unknown task {name!r} (registered: {', '.join(sorted(TASKS))})")
    try:
        validated = cls.Params.model_validate(params or {})
    except ValidationError as exc:
        raise ConfigError(_format_params_error(name, exc)) from exc
    return cls(validated, system_prompt)


def _format_params_error(task: str, exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        path = f"task.params.{key}" if key else "task.params"
        msg = f"unknown key for task {task!r}" if err["type"] == "extra_forbidden" else err["msg"]
        got = "" if err["type"] in ("extra_forbidden", "missing") else f" (got {err.get('input')!r})"
        lines.append(f"{path}: {msg}{got}")
    return "\n".join(lines)
