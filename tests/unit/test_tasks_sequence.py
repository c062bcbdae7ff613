"""The one-sequence multi-turn builder: sampled tokens kept as sampled, environment tokens from text
renders; with a ChatML-like fake template, and the guessing game with the REAL tiny model's
byte-level tokenizer and replies that are not valid UTF-8."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from stream_rl.config import SamplingConfig
from stream_rl.contracts import ChatMessage, Verdict, VersionSpan, validate_spans
from stream_rl.errors import TaskError
from stream_rl.tasks import Completion, get_task
from stream_rl.tasks.sequence import TurnSequence

pytestmark = pytest.mark.unit

IM_START, IM_END, NL = 1000, 1001, ord("\n")


def chars(text: str) -> list[int]:
    return [*map(ord, text)]


class ChatML:
    """`<im_start>role\\ncontent<im_end>\\n` per message: an assistant turn closes with TWO tokens."""

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        ids: list[int] = []
        for m in messages:
            ids += [IM_START, *chars(m.role), NL, *chars(m.content), IM_END, NL]
        return ids + [IM_START, *chars("assistant"), NL] if add_generation_prompt else ids


def completion(ids: list[int], text: str, version: int = 0, finish_reason: str = "stop") -> Completion:
    logprobs = [-0.5] * len(ids)
    return Completion([], ids, logprobs, [VersionSpan(version, 0)], text, finish_reason)


def test_closing_tokens_the_model_sampled_are_not_repeated_and_missing_ones_are_added() -> None:
    template = ChatML()
    seq = TurnSequence(template, [ChatMessage("user", "hi")])
    seq.add_model_turn(completion([*chars("ok"), IM_END], "ok"))
    seq.add_environment_turn([ChatMessage("user", "more")])
    # <im_end> was sampled: only the "\n" that follows it in the template is the environment's.
    env1 = [NL, IM_START, *chars("user"), NL, *chars("more"), IM_END, NL, IM_START, *chars("assistant"), NL]
    assert seq.token_ids == [*chars("ok"), IM_END, *env1]
    assert seq.mask == [True] * 3 + [False] * len(env1)
    seq.add_model_turn(completion(chars("no"), "no", version=2, finish_reason="length"))
    seq.add_environment_turn([ChatMessage("user", "bye")], generation_prompt=False)
    # Cut at max_tokens: the whole closing is the environment's, and no generation prompt at the end.
    env2 = [IM_END, NL, IM_START, *chars("user"), NL, *chars("bye"), IM_END, NL]
    assert seq.token_ids[-len(env2) - 2 :] == [*chars("no"), *env2]
    assert seq.mask.count(True) == 5 and seq.logprobs.count(0.0) == len(env1) + len(env2)
    assert seq.all_token_ids == template.render(seq.messages, add_generation_prompt=False)
    assert seq.version_spans() == [VersionSpan(0, 0), VersionSpan(2, 3 + len(env1))]
    with pytest.raises(TaskError, match="after the conversation ended"):
        seq.add_model_turn(completion(chars("x"), "x"))


def test_turns_must_alternate() -> None:
    seq = TurnSequence(ChatML(), [ChatMessage("user", "hi")])
    with pytest.raises(TaskError, match="must follow a model turn"):
        seq.add_environment_turn([ChatMessage("user", "again")])
    seq.add_model_turn(completion([*chars("ok"), IM_END], "ok"))
    with pytest.raises(TaskError, match="model turn 2 follows model turn 1"):
        seq.add_model_turn(completion(chars("ok"), "ok"))


class EmptyRepliesShown(ChatML):
    """Renders an empty reply as a placeholder: where a reply ends cannot be learnt from it."""

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        shown = [ChatMessage(m.role, m.content or "(none)") for m in messages]
        return super().render(shown, add_generation_prompt)


def test_a_template_whose_closing_cannot_be_found_is_a_clear_error() -> None:
    seq = TurnSequence(EmptyRepliesShown(), [ChatMessage("user", "hi")])
    seq.add_model_turn(completion([*chars("ok"), IM_END], "ok"))
    with pytest.raises(TaskError, match="cannot tell where the reply ends"):
        seq.add_environment_turn([ChatMessage("user", "more")])


# -- the real tiny model's tokenizer ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """(the actor's `ChatTokenizer` over the tiny model's tokenizer, the raw tokenizer)."""
    from stream_rl.inference.model_maker import build_tokenizer
    from stream_rl.stages.rollouts import ChatTokenizer

    path: Path = tmp_path_factory.mktemp("tokenizer")
    raw = build_tokenizer()
    raw.save_pretrained(path)
    return ChatTokenizer(str(path)), raw


def byte_ids(data: bytes) -> list[int]:
    return [6 + b for b in data]  # ids 0-5 are the specials; id 6 + b is byte b


class ByteScriptedClient:
    """The actor's tokenizer for render/decode; replies are scripted BYTES, decoded as the server does
    (`decode(ids, skip_special_tokens=True)`), so invalid UTF-8 becomes U+FFFD in the text."""

    def __init__(self, chat: Any, raw: Any, script: list[tuple[bytes, bool, int]]) -> None:
        self.chat, self.raw = chat, raw
        self.script = list(script)  # (reply bytes, ended with <|end|>, weights version)
        self.prompts: list[list[int]] = []
        self.sampled: list[list[int]] = []
        self.logprobs: list[list[float]] = []

    async def complete(self, prompt_token_ids: list[int], sampling: SamplingConfig) -> Completion:
        self.prompts.append(list(prompt_token_ids))
        data, ended, version = self.script.pop(0)
        ids = byte_ids(data) + ([self.raw.eos_token_id] if ended else [])
        self.sampled.append(ids)
        text = self.raw.decode(ids, skip_special_tokens=True)
        logprobs = [-0.1 * len(self.prompts) - 0.001 * i for i in range(len(ids))]
        self.logprobs.append(logprobs)
        finish = "stop" if ended else "length"
        return Completion(list(prompt_token_ids), ids, logprobs, [VersionSpan(version, 0)], text, finish)

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        result: list[int] = self.chat.render(messages, add_generation_prompt)
        return result

    def decode(self, token_ids: list[int]) -> str:
        result: str = self.chat.decode(token_ids)
        return result


def test_invalid_utf8_replies_of_the_tiny_model_keep_their_sampled_tokens(
    tokenizers: tuple[Any, Any],
) -> None:
    chat, raw = tokenizers
    assert raw.eos_token == "<|end|>"
    script = [
        (b"\xff\xfe<answer>8</answer>\xe2\x82", True, 3),  # ends with <|end|>
        (b"<answer>3</answer>\xf0\x9f", False, 3),  # cut at max_tokens mid-character
        (b"\xc3<answer>5</answer>", True, 4),
    ]
    task = get_task("guessing", {"max_number": 16, "max_turns": 4})
    problem = next(p for p in task.load_problems("run", 0) if p.answer == "5")
    client = ByteScriptedClient(chat, raw, script)
    r = asyncio.run(task.generate_rollout(client, problem, SamplingConfig()))
    assert r.scored.verdict is Verdict.CORRECT and r.scored.reward == pytest.approx(1.8) and r.num_turns == 3
    assert r.finish_reason == "stop" and task.score(problem, r.text) == r.scored

    # Each call's prompt is exactly the sequence before it; the sampled ids sit there untouched.
    n = len(r.completion_token_ids)
    offsets = [len(p) - len(r.prompt_token_ids) for p in client.prompts]
    assert r.prompt_token_ids == chat.render(list(problem.prompt))
    sampled_at: list[int] = []
    for prompt, off, ids in zip(client.prompts, offsets, client.sampled, strict=True):
        assert prompt == r.prompt_token_ids + r.completion_token_ids[:off]
        assert r.completion_token_ids[off : off + len(ids)] == ids
        sampled_at += range(off, off + len(ids))
    assert [i for i in range(n) if r.completion_mask[i]] == sampled_at
    assert [r.logprobs[i] for i in sampled_at] == [lp for turn in client.logprobs for lp in turn]
    assert all(r.logprobs[i] == 0.0 for i in range(n) if not r.completion_mask[i])
    validate_spans(r.version_spans, n, "test")
    assert r.version_spans == [VersionSpan(3, 0), VersionSpan(4, offsets[2])]

    # The environment's turns read as the intended messages; <|end|> closes the cut reply once.
    ends = [off + len(ids) for off, ids in zip(offsets, client.sampled, strict=True)]
    env = [r.completion_token_ids[a:b] for a, b in zip(ends, [*offsets[1:], n], strict=True)]
    assert [raw.decode(ids, skip_special_tokens=False) for ids in env] == [
        "<|user|>8 is wrong: the number is lower. Guess again.<|end|><|assistant|>",
        "<|end|><|user|>3 is wrong: the number is higher. Guess again.<|end|><|assistant|>",
        "<|user|>Correct, the number is 5. [game over: correct, turn 3]<|end|>",
    ]
    # What made the old builder fail: the replies' text does not re-encode to the sampled bytes.
    assert all("\ufffd" in text for text in r.turn_texts)
    first = len(r.prompt_token_ids) + ends[0]
    as_text = chat.render([*problem.prompt, ChatMessage("assistant", r.turn_texts[0])], False)
    assert as_text[:first] != r.prompt_token_ids + r.completion_token_ids[: ends[0]]
