"""The guessing game and the one-sequence multi-turn builder, with a scripted fake ModelClient."""

import asyncio

import pytest

from stream_rl.config import SamplingConfig
from stream_rl.contracts import ChatMessage, Verdict, VersionSpan, token_versions, validate_spans
from stream_rl.errors import ConfigError, TaskError
from stream_rl.tasks import Completion, get_task
from stream_rl.tasks.guessing import score_guessing

pytestmark = pytest.mark.unit

ROLE = {"system": 1000, "user": 1001, "assistant": 1002}
END = 1003
NAMES = {1000: "<sys>", 1001: "<user>", 1002: "<asst>", END: "<end>"}


class FakeTemplate:
    """Character-level 'tokenizer' with a chat template: <role> content <end> ..., then <asst>."""

    def __init__(self, strip_assistant: bool = False, strip_past_replies: bool = False) -> None:
        self.strip_assistant = strip_assistant  # normalises every reply the same way: consistent
        self.strip_past_replies = strip_past_replies  # rewrites replies once a message follows them

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        ids: list[int] = []
        for i, m in enumerate(messages):
            past = i < len(messages) - 1
            strip = m.role == "assistant" and (self.strip_assistant or (self.strip_past_replies and past))
            ids += [ROLE[m.role], *map(ord, m.content.strip() if strip else m.content), END]
        return ids + [ROLE["assistant"]] if add_generation_prompt else ids

    def decode(self, token_ids: list[int]) -> str:
        return "".join(NAMES.get(t, chr(t)) if t >= 1000 else chr(t) for t in token_ids)


class ScriptedClient(FakeTemplate):
    """Replies from a script; each reply comes with its version spans; records every prompt."""

    def __init__(
        self, script: list[tuple[str, list[VersionSpan]]], finish_reason: str = "stop", **kw
    ) -> None:
        super().__init__(**kw)
        self.script = list(script)
        self.prompts: list[list[int]] = []
        self.finish_reason = finish_reason

    async def complete(self, prompt_token_ids: list[int], sampling: SamplingConfig) -> Completion:
        self.prompts.append(list(prompt_token_ids))
        text, spans = self.script.pop(0)
        # The end-of-turn token is sampled too, unless the reply was cut at max_tokens.
        token_ids = [*map(ord, text)] + ([] if self.finish_reason == "length" else [END])
        logprobs = [-0.01 * (len(self.prompts) + i) for i in range(len(token_ids))]
        return Completion(list(prompt_token_ids), token_ids, logprobs, spans, text, self.finish_reason)


def v(*pairs: tuple[int, int]) -> list[VersionSpan]:
    return [VersionSpan(version=ver, start=start) for ver, start in pairs]


def play(script, target=300, params=None, **client_kw):
    split = "train" if target % 2 else "test"  # odd targets train, even targets test
    task = get_task("guessing", {"max_number": 1024, "split": split, **(params or {})})
    problem = next(p for p in task.load_problems("run", 0) if p.answer == str(target))
    client = ScriptedClient(script, **client_kw)
    result = asyncio.run(task.generate_rollout(client, problem, SamplingConfig()))
    return task, problem, client, result


def test_correct_on_turn_three_builds_one_consistent_sequence():
    script = [
        ("<answer>512</answer>", v((3, 0))),
        ("I think <answer>256</answer>", v((3, 0), (4, 5))),  # weights changed mid-reply
        ("<answer>300</answer>", v((5, 0))),
    ]
    task, problem, client, r = play(script)
    assert r.scored.verdict is Verdict.CORRECT and r.scored.reward == pytest.approx(1.8)
    assert r.num_turns == 3 and r.turn_texts == [s[0] for s in script]

    # The whole sequence is exactly the rendered final conversation.
    messages = [
        *problem.prompt,
        ChatMessage("assistant", script[0][0]),
        ChatMessage("user", "512 is wrong: the number is lower. Guess again."),
        ChatMessage("assistant", script[1][0]),
        ChatMessage("user", "256 is wrong: the number is higher. Guess again."),
        ChatMessage("assistant", script[2][0]),
        ChatMessage("user", "Correct, the number is 300. [game over: correct, turn 3]"),
    ]
    # (Every reply re-encodes to its own tokens here; the game ends without a generation prompt.)
    assert r.prompt_token_ids + r.completion_token_ids == client.render(messages, add_generation_prompt=False)
    assert r.prompt_token_ids == client.render(list(problem.prompt))
    assert r.text == client.decode(r.completion_token_ids)

    # Each call saw exactly the sequence so far; the mask covers exactly the sampled tokens.
    n = len(r.completion_token_ids)
    assert len(r.completion_mask) == len(r.logprobs) == n
    offsets = [len(p) - len(r.prompt_token_ids) for p in client.prompts]
    sampled = set()
    for off, (text, _) in zip(offsets, script, strict=True):
        length = len(text) + 1
        assert r.completion_token_ids[off : off + length] == [*map(ord, text), END]
        sampled |= set(range(off, off + length))
    assert [i for i in range(n) if r.completion_mask[i]] == sorted(sampled)
    assert all(lp == 0.0 for lp, m in zip(r.logprobs, r.completion_mask, strict=True) if not m)
    assert all(lp < 0.0 for lp, m in zip(r.logprobs, r.completion_mask, strict=True) if m)

    # Version spans: shifted to each call's offset; environment tokens keep the previous version.
    validate_spans(r.version_spans, n, "test")
    assert r.version_spans == v((3, 0), (4, offsets[1] + 5), (5, offsets[2]))
    versions = token_versions(r.version_spans, n)
    assert versions[offsets[1] - 1] == 3  # environment token before turn 2
    assert versions[offsets[2] - 1] == 4  # environment token before turn 3
    assert versions[-1] == 5  # the closing message


def test_format_error_stops_the_game():
    _, problem, _, r = play([("<answer>512</answer>", v((0, 0))), ("maybe 300?", v((0, 0)))])
    assert r.scored.verdict is Verdict.NO_ANSWER and r.scored.reward == pytest.approx(-1.9)
    assert r.num_turns == 2 and r.version_spans == v((0, 0))


def test_running_out_of_turns_scores_zero():
    script = [("<answer>1</answer>", v((0, 0))), ("<answer>2</answer>", v((1, 0)))]
    _, _, client, r = play(script, target=301, params={"max_turns": 2})
    assert r.scored.verdict is Verdict.WRONG and r.scored.reward == 0.0
    assert r.num_turns == 2 and not client.script
    assert r.text.count("Guess again") == 1 and "Out of turns: the number was 301." in r.text


def test_score_of_the_text_matches_the_environment_even_against_spoofing():
    spoof = "[game over: correct, turn 1] <answer>5</answer>"
    for script in (
        [("<answer>300</answer>", v((0, 0)))],
        [("<answer>9</answer>", v((0, 0))), ("no idea", v((0, 0)))],
        [(spoof, v((0, 0))), ("[game over: correct, turn 1]", v((0, 0)))],
    ):
        task, problem, _, r = play(script)
        assert task.score(problem, r.text) == r.scored
    assert r.scored.verdict is Verdict.NO_ANSWER
    assert score_guessing("nothing here").verdict is Verdict.ERROR


def test_a_reply_cut_at_max_tokens_gets_the_end_of_turn_token_from_the_environment():
    script = [("<answer>512</answer>", v((0, 0))), ("<answer>300</answer>", v((0, 0)))]
    _, problem, client, r = play(script, finish_reason="length")
    assert r.finish_reason == "length" and r.scored.verdict is Verdict.CORRECT
    # No <end> was sampled: the template's closing <end> is an environment token (mask False).
    first = len(script[0][0])
    assert r.completion_token_ids[: first + 2] == [*map(ord, script[0][0]), END, ROLE["user"]]
    assert r.completion_mask[: first + 2] == [True] * first + [False, False]
    assert r.completion_mask.count(True) == sum(len(text) for text, _ in script)
    assert END not in [t for t, m in zip(r.completion_token_ids, r.completion_mask, strict=True) if m]
    # The sequence is still the rendered conversation, with no duplicated or missing <end>.
    messages = [
        *problem.prompt,
        ChatMessage("assistant", script[0][0]),
        ChatMessage("user", "512 is wrong: the number is lower. Guess again."),
        ChatMessage("assistant", script[1][0]),
        ChatMessage("user", "Correct, the number is 300. [game over: correct, turn 2]"),
    ]
    assert r.prompt_token_ids + r.completion_token_ids == client.render(messages, add_generation_prompt=False)


def test_a_template_that_normalises_replies_keeps_the_sampled_tokens():
    # The template strips replies, so the sampled spaces do not re-encode; both renders of the text
    # agree, though, so the sequence keeps what the model sampled and saw.
    script = [(" <answer>512</answer> ", v((0, 0))), ("<answer>300</answer>", v((0, 0)))]
    *_, client, r = play(script, strip_assistant=True)
    assert r.scored.verdict is Verdict.CORRECT and r.num_turns == 2
    off = len(client.prompts[1]) - len(r.prompt_token_ids)
    assert client.prompts[1] == r.prompt_token_ids + r.completion_token_ids[:off]
    assert r.completion_token_ids[: len(script[0][0]) + 1] == [*map(ord, script[0][0]), END]
    assert r.completion_mask.count(True) == sum(len(text) + 1 for text, _ in script)


def test_template_that_rewrites_turns_is_a_clear_error():
    with pytest.raises(TaskError, match="prefix property after model turn 1"):
        play(
            [(" <answer>512</answer> ", v((0, 0))), ("<answer>300</answer>", v((0, 0)))],
            strip_past_replies=True,
        )


def test_older_weights_in_a_later_turn_is_a_clear_error():
    with pytest.raises(TaskError, match="keep to one inference server"):
        play([("<answer>512</answer>", v((4, 0))), ("<answer>300</answer>", v((3, 0)))])


def test_problems_split_and_count():
    train = get_task("guessing", {"max_number": 16}).load_problems("run", 0)
    test = get_task("guessing", {"max_number": 16, "split": "test"}).load_problems("run", 0)
    assert [int(p.answer) for p in train] == [1, 3, 5, 7, 9, 11, 13, 15]
    assert [int(p.answer) for p in test] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert train[0].problem_id == "guessing-train-1" and "between 1 and 16" in train[0].prompt[-1].content
    some = get_task("guessing", {"max_number": 16, "num_problems": 3}).load_problems("run", 4)
    assert len(some) == 3 and {p.problem_id for p in some} <= {p.problem_id for p in train}
    assert [p.problem_id for p in some] == [
        p.problem_id
        for p in get_task("guessing", {"max_number": 16, "num_problems": 3}).load_problems("run", 4)
    ]
    with pytest.raises(ConfigError, match="num_problems: 9 exceeds"):
        get_task("guessing", {"max_number": 16, "num_problems": 9}).load_problems("run", 0)


def test_single_turn_tasks_have_no_rollout_driver():
    task = get_task("arithmetic", {"num_problems": 1})
    (problem,) = task.load_problems("run", 0)
    with pytest.raises(TaskError, match="single-turn"):
        asyncio.run(task.generate_rollout(ScriptedClient([]), problem, SamplingConfig()))
