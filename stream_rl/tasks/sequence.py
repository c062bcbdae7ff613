"""Building ONE token sequence out of a multi-turn conversation (model turns + environment turns).

The sequence is the first prompt's tokens, then for each turn:
- the model's completion: its sampled tokens (mask True), their behaviour logprobs, and its
  version spans shifted to where the completion starts in the sequence;
- the environment's reply: the tokens `render(conversation so far)` adds after the tokens so far
  (mask False, logprob 0.0).

Invariants:
- Prefix property: every `render(conversation)` must start with exactly the tokens so far,
  sampled tokens included. A chat template that rewrites earlier turns (strips whitespace, drops
  reasoning, re-tokenises the reply differently) breaks it, and `add_environment_turn` raises
  `TaskError` saying where, rather than train on tokens the model never saw.
- Version spans stay valid (`stream_rl.contracts.validate_spans`): environment tokens take the
  version of the span before them; spans of equal version merge; a later model call with an
  OLDER version than an earlier one raises `TaskError` (the client must stay on one server,
  whose versions only grow).
"""

from __future__ import annotations

from stream_rl.contracts import VersionSpan, validate_spans
from stream_rl.errors import TaskError
from stream_rl.tasks.base import Completion


class TurnSequence:
    """Accumulates the completion side of one multi-turn rollout."""

    def __init__(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise TaskError("multi-turn rollout: the rendered first prompt is empty")
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids: list[int] = []
        self.mask: list[bool] = []
        self.logprobs: list[float] = []
        self.spans: list[VersionSpan] = []
        self.turns = 0
        self._last_version: int | None = None

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then completion so far: the next model call's prompt."""
        return self.prompt_token_ids + self.token_ids

    def add_model_turn(self, completion: Completion) -> None:
        n = len(completion.token_ids)
        if len(completion.logprobs) != n:
            raise TaskError(
                f"model turn {self.turns + 1}: {len(completion.logprobs)} logprobs for {n} tokens"
            )
        validate_spans(completion.version_spans, n, f"model turn {self.turns + 1}")
        offset = len(self.token_ids)
        for span in completion.version_spans:
            if self._last_version is not None and span.version < self._last_version:
                raise TaskError(
                    f"model turn {self.turns + 1} was sampled with weights version {span.version}, older "
                    f"than the {self._last_version} of an earlier token: a multi-turn rollout must keep "
                    "to one inference server"
                )
            self._last_version = span.version
            if n == 0 or (self.spans and self.spans[-1].version == span.version):
                continue  # nothing to cover, or the same version continues
            self.spans.append(VersionSpan(version=span.version, start=offset + span.start))
        self.token_ids.extend(completion.token_ids)
        self.mask.extend([True] * n)
        self.logprobs.extend(completion.logprobs)
        self.turns += 1

    def add_environment_turn(self, rendered: list[int]) -> None:
        """Append what `rendered` (the whole conversation, rendered) adds after the tokens so far."""
        so_far = self.all_token_ids
        if rendered[: len(so_far)] != so_far:
            at = next(
                (i for i, (a, b) in enumerate(zip(rendered, so_far, strict=False)) if a != b),
                min(len(rendered), len(so_far)),
            )
            raise TaskError(
                f"chat template breaks the prefix property after model turn {self.turns}: the rendered "
                f"conversation differs from the tokens so far at position {at} of {len(so_far)} "
                f"(rendered {rendered[at : at + 8]}, expected {so_far[at : at + 8]}); a template that "
                "rewrites earlier turns cannot be trained as one sequence"
            )
        delta = rendered[len(so_far) :]
        self.token_ids.extend(delta)
        self.mask.extend([False] * len(delta))
        self.logprobs.extend([0.0] * len(delta))

    def version_spans(self) -> list[VersionSpan]:
        """Spans over the whole completion (validated)."""
        spans = [VersionSpan(s.version, s.start) for s in self.spans]
        if self.token_ids and not spans:
            if self._last_version is None:
                raise TaskError("multi-turn rollout has tokens but no model turn gave a weights version")
            spans = [VersionSpan(self._last_version, 0)]
        if spans and spans[0].start > 0:
            # Environment tokens before the first sampled token take the first sampled version.
            spans[0] = VersionSpan(spans[0].version, 0)
        validate_spans(spans, len(self.token_ids), "multi-turn rollout")
        return spans
