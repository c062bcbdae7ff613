"""Building ONE token sequence out of a multi-turn conversation (model turns + environment turns).

The sequence is the first prompt's tokens (the chat template applied to the problem's messages,
with the generation prompt), then for each turn:
- the model's completion: its sampled tokens exactly as sampled (mask True), their behaviour
  logprobs, and its version spans shifted to where the completion starts in the sequence;
- the environment's reply (mask False, logprob 0.0): what the template writes to close the
  assistant turn and not already sampled, then the environment's messages and (unless the
  conversation ends there) the next generation prompt.

Environment tokens come from renders of the TEXT conversation only, never from re-encoding the
sampled tokens: those need not be the canonical encoding of their text (a byte-level model
emits invalid UTF-8, a BPE model a non-canonical split), so `render(conversation)` need not
start with the tokens so far. With, for the model turn just taken,
  P = render(messages before the reply, generation prompt)     `...<|assistant|>`
  A = render(... + assistant(reply text))                        `...<|assistant|>reply<|end|>`
  E = render(... + assistant(""))                               `...<|assistant|><|end|>`
  R = render(... + assistant(reply text) + environment messages, generation prompt if continuing)
the template's closing of an assistant turn is `C = E - P` (`<|end|>`; `<|im_end|>\\n` in ChatML)
and the environment's tokens are `R - A`. Of `C`, only the part the completion did not sample
is added: one that stopped on the end-of-turn token sampled `C`'s first token; one cut at
`max_tokens` sampled none of it, and `C` is added whole.

Invariants:
- The sampled tokens are never changed and the mask is True exactly on them: they are what the
  behaviour logprobs refer to, and each model call's prompt is exactly the sequence before it.
  So the sequence equals the render of the final text conversation only when every reply
  re-encodes to its own tokens.
- Prefix property between TEXT renders: `A` and `E` start with `P`, `A` ends with `C`, and `R`
  starts with `A`. A template that renders earlier turns differently once later ones exist
  (drops past reasoning, rewrites past replies) breaks it, and `add_environment_turn` raises
  `TaskError` saying where, rather than train on a conversation the model never saw.
- Version spans stay valid (`stream_rl.contracts.validate_spans`): environment tokens take the
  version of the span before them; spans of equal version merge; a later model call with an
  OLDER version than an earlier one raises `TaskError` (the client must stay on one server,
  whose versions only grow).
- Turns alternate: model, environment, model, ...; no model turn after an environment turn
  rendered without the generation prompt (the conversation ended there).
"""

from __future__ import annotations

from typing import Protocol

from stream_rl.contracts import ChatMessage, VersionSpan, validate_spans
from stream_rl.errors import TaskError
from stream_rl.tasks.base import Completion


class Renderer(Protocol):
    """The part of `ModelClient` the sequence needs: the chat template over text messages."""

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]: ...


class TurnSequence:
    """Accumulates one multi-turn rollout: the text conversation and its token sequence."""

    def __init__(self, renderer: Renderer, messages: list[ChatMessage]) -> None:
        """`messages`: the first prompt (rendered with the generation prompt)."""
        self._renderer = renderer
        self.messages = list(messages)
        """The text conversation so far (replies as the model's decoded text)."""
        self.prompt_token_ids = renderer.render(self.messages, add_generation_prompt=True)
        if not self.prompt_token_ids:
            raise TaskError("multi-turn rollout: the rendered first prompt is empty")
        self.token_ids: list[int] = []
        self.mask: list[bool] = []
        self.logprobs: list[float] = []
        self.spans: list[VersionSpan] = []
        self.turns = 0
        self._last_version: int | None = None
        self._turn_prompt: list[int] | None = list(self.prompt_token_ids)
        """P: the text render the next model turn answers (None once the conversation ended)."""
        self._sampled: list[int] | None = None
        """The last model turn's tokens, until the environment replies."""

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then completion so far: the next model call's prompt."""
        return self.prompt_token_ids + self.token_ids

    def add_model_turn(self, completion: Completion) -> None:
        """Append the completion's sampled tokens as they are; its `text` joins the conversation."""
        turn = self.turns + 1
        if self._sampled is not None:
            raise TaskError(
                f"model turn {turn} follows model turn {self.turns}: the environment replies in between"
            )
        if self._turn_prompt is None:
            raise TaskError(f"model turn {turn} after the conversation ended (no generation prompt)")
        n = len(completion.token_ids)
        if len(completion.logprobs) != n:
            raise TaskError(f"model turn {turn}: {len(completion.logprobs)} logprobs for {n} tokens")
        validate_spans(completion.version_spans, n, f"model turn {turn}")
        offset = len(self.token_ids)
        for span in completion.version_spans:
            if self._last_version is not None and span.version < self._last_version:
                raise TaskError(
                    f"model turn {turn} was sampled with weights version {span.version}, older "
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
        self.messages.append(ChatMessage("assistant", completion.text))
        self._sampled = list(completion.token_ids)
        self.turns = turn

    def add_environment_turn(self, messages: list[ChatMessage], *, generation_prompt: bool = True) -> None:
        """Append the environment's `messages` after the last model turn (see the module doc).

        `generation_prompt=False` ends the conversation: no model turn may follow.
        """
        if self._sampled is None or self._turn_prompt is None:
            raise TaskError(f"environment turn after model turn {self.turns}: it must follow a model turn")
        render = self._renderer.render
        prompt = self._turn_prompt
        reply = render(self.messages, add_generation_prompt=False)
        empty = render([*self.messages[:-1], ChatMessage("assistant", "")], add_generation_prompt=False)
        after = render([*self.messages, *messages], add_generation_prompt=generation_prompt)
        self._require_prefix(prompt, empty, "the turn's prompt", "the conversation with an empty reply")
        self._require_prefix(prompt, reply, "the turn's prompt", "the conversation with the model's reply")
        closing = empty[len(prompt) :]
        if len(reply) < len(prompt) + len(closing) or reply[len(reply) - len(closing) :] != closing:
            raise TaskError(
                f"chat template closes the assistant reply of model turn {self.turns} with "
                f"{reply[-len(closing) - 2 :]} but an empty reply with {closing}: cannot tell where the "
                "reply ends"
            )
        self._require_prefix(
            reply, after, "the conversation so far", "the conversation with the environment's reply"
        )
        tokens = closing[_sampled_overlap(self._sampled, closing) :] + after[len(reply) :]
        self.token_ids.extend(tokens)
        self.mask.extend([False] * len(tokens))
        self.logprobs.extend([0.0] * len(tokens))
        self.messages.extend(messages)
        self._turn_prompt = after if generation_prompt else None
        self._sampled = None

    def _require_prefix(self, prefix: list[int], full: list[int], what: str, rendered: str) -> None:
        if full[: len(prefix)] == prefix:
            return
        at = next(
            (i for i, (a, b) in enumerate(zip(full, prefix, strict=False)) if a != b),
            min(len(full), len(prefix)),
        )
        raise TaskError(
            f"chat template breaks the prefix property after model turn {self.turns}: rendered from "
            f"text, {rendered} does not start with {what} (they differ at position {at} of "
            f"{len(prefix)}: got {full[at : at + 8]}, expected {prefix[at : at + 8]}); a template that "
            "rewrites earlier turns cannot be trained as one sequence"
        )

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


def _sampled_overlap(sampled: list[int], closing: list[int]) -> int:
    """The longest k such that the sampled tokens end with `closing[:k]` (0 when none)."""
    for k in range(min(len(sampled), len(closing)), 0, -1):
        if sampled[len(sampled) - k :] == closing[:k]:
            return k
    return 0
