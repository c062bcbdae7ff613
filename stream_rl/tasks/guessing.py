"""`guessing`: PipelineRL's multi-turn number-guessing game, as one chat conversation.

The model must find a number in `1..max_number` within `max_turns` turns, answering each turn
with `<answer>N</answer>` (the first such tag of a reply counts). After a wrong guess the
environment says whether the number is higher or lower, and the model guesses again. Reward, with
`i` the 0-based turn of the final reply (as PipelineRL): `2 - i/10` for a correct guess,
`-2 + i/10` for a reply without a guess (the game stops there), `0` when the turns run out.

Problems: targets are the odd numbers of `1..max_number` for `split: train` and the even ones
for `split: test` (PipelineRL's split for 1024); `num_problems` draws that many with the run
seed. Ids are `guessing-<split>-<target>`.

The rollout (`generate_rollout`) is one token sequence (see `stream_rl.tasks.sequence`): the
model's sampled tokens as sampled, the environment's messages rendered from the text
conversation. When the game ends, the environment adds a closing message (with no generation
prompt after it) with a marker, `[game over: <outcome>, turn <k>]`: so the rollout's text
carries the environment's result, and `score(problem, text)` (what the verifier stage calls)
recomputes the same verdict and reward from the LAST marker, which only the environment can
write (nothing the model says comes after it).
"""

from __future__ import annotations

import random
import re
from typing import Literal

from pydantic import Field

from stream_rl.config import SamplingConfig
from stream_rl.contracts import ChatMessage, Problem, Verdict
from stream_rl.errors import ConfigError, TaskError
from stream_rl.tasks.base import ModelClient, MultiTurnResult, Scored, Task, TaskParams, register_task
from stream_rl.tasks.sequence import TurnSequence

Outcome = Literal["correct", "no_answer", "out_of_turns"]
_GUESS = re.compile(r"<answer>\s*(\d+)\s*</answer>")
_MARKER = re.compile(r"\[game over: (correct|no_answer|out_of_turns), turn (\d+)\]")


class GuessingParams(TaskParams):
    max_number: int = Field(1024, ge=2)
    """The number is in 1..max_number."""
    max_turns: int = Field(13, ge=1)
    """Model replies allowed (13 finds any number of 1..1024 with bisection and room to spare)."""
    split: Literal["train", "test"] = "train"
    """`train`: odd targets; `test`: even targets."""
    num_problems: int | None = Field(None, ge=1)
    """Draw this many targets of the split (with the run seed); None: all of them."""
    eval_problems: int | None = Field(100, ge=1)
    """Held-out targets, drawn from the other split (None: all of it)."""


def parse_guess(reply: str) -> int | None:
    match = _GUESS.search(reply)
    return int(match.group(1)) if match else None


def game_result(outcome: str, turn: int) -> Scored:
    """Verdict and reward of a game that ended with `outcome` at 1-based `turn`."""
    i = turn - 1
    if outcome == "correct":
        return Scored(Verdict.CORRECT, 2.0 - i / 10, f"found at turn {turn}")
    if outcome == "no_answer":
        return Scored(Verdict.NO_ANSWER, -2.0 + i / 10, f"no <answer>N</answer> at turn {turn}")
    return Scored(Verdict.WRONG, 0.0, f"not found in {turn} turns")


def score_guessing(transcript: str) -> Scored:
    """The result the environment wrote at the end of a rollout's text (a plain function)."""
    markers = _MARKER.findall(transcript)
    if not markers:
        return Scored(Verdict.ERROR, 0.0, "no game result in the text: not a guessing rollout")
    outcome, turn = markers[-1]
    return game_result(outcome, int(turn))


def feedback(guess: int, target: int) -> str:
    direction = "higher" if target > guess else "lower"
    return f"{guess} is wrong: the number is {direction}. Guess again."


def closing_message(outcome: Outcome, turn: int, target: int) -> str:
    text = {
        "correct": f"Correct, the number is {target}.",
        "no_answer": "Your reply has no <answer>number</answer>.",
        "out_of_turns": f"Out of turns: the number was {target}.",
    }[outcome]
    return f"{text} [game over: {outcome}, turn {turn}]"


@register_task("guessing")
class GuessingTask(Task):
    Params = GuessingParams
    params: GuessingParams
    multi_turn = True

    @property
    def eval_split(self) -> str:
        return "test" if self.params.split == "train" else "train"

    def load_problems(self, run_id: str, seed: int) -> list[Problem]:
        return self._problems(run_id, seed, self.params.split, self.params.num_problems, "num_problems")

    def load_eval_problems(self, run_id: str, seed: int) -> list[Problem]:
        return self._problems(run_id, seed, self.eval_split, self.params.eval_problems, "eval_problems")

    def _problems(self, run_id: str, seed: int, split: str, count: int | None, key: str) -> list[Problem]:
        p = self.params
        targets = list(range(1 if split == "train" else 2, p.max_number + 1, 2))
        if count is not None:
            if count > len(targets):
                raise ConfigError(
                    f"task.params.{key}: {count} exceeds the {len(targets)} "
                    f"{split} targets of 1..{p.max_number}"
                )
            targets = sorted(random.Random(seed).sample(targets, count))
        instructions = (
            f"Guess a number between 1 and {p.max_number}. Reply with your guess as <answer>number</answer>. "
            f"After each guess I will tell you whether the number is higher or lower. You have "
            f"{p.max_turns} guesses."
        )
        return [
            self.make_problem(
                run_id,
                problem_id=f"guessing-{split}-{target}",
                user_content=instructions,
                answer=str(target),
                metadata={"split": split, "max_number": str(p.max_number)},
            )
            for target in targets
        ]

    def score(self, problem: Problem, completion: str, *, finish_reason: str = "stop") -> Scored:
        return score_guessing(completion)

    async def generate_rollout(
        self, client: ModelClient, problem: Problem, sampling: SamplingConfig
    ) -> MultiTurnResult:
        if problem.answer is None or not problem.answer.isdigit():
            raise TaskError(
                f"guessing problem {problem.problem_id}: answer {problem.answer!r} is not a number"
            )
        target = int(problem.answer)
        seq = TurnSequence(client, list(problem.prompt))
        turn_texts: list[str] = []
        finish_reason = "stop"
        outcome: Outcome = "out_of_turns"
        for turn in range(1, self.params.max_turns + 1):
            completion = await client.complete(seq.all_token_ids, sampling)
            seq.add_model_turn(completion)
            turn_texts.append(completion.text)
            finish_reason = completion.finish_reason
            guess = parse_guess(completion.text)
            if guess is None:
                outcome = "no_answer"
                break
            if guess == target:
                outcome = "correct"
                break
            if turn < self.params.max_turns:
                seq.add_environment_turn([ChatMessage("user", feedback(guess, target))])
        closing = ChatMessage("user", closing_message(outcome, seq.turns, target))
        seq.add_environment_turn([closing], generation_prompt=False)  # the game ends there
        return MultiTurnResult(
            prompt_token_ids=seq.prompt_token_ids,
            completion_token_ids=seq.token_ids,
            completion_mask=seq.mask,
            logprobs=seq.logprobs,
            version_spans=seq.version_spans(),
            text=client.decode(seq.token_ids),
            finish_reason=finish_reason,
            num_turns=seq.turns,
            scored=game_result(outcome, seq.turns),
            turn_texts=turn_texts,
        )
