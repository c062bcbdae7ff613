"""`arithmetic`: the toy task of the CPU demo, sized for a ~0.5M-parameter model.

Problems are `a<op>b=` with integer operands in `[min_operand, max_operand]` and `op` in `ops`;
the user message is exactly that text (e.g. `37+45=`) and the ideal completion is the answer's
digits (a leading `-` for negative differences), then end of sequence. Problems are distinct
operand/operator triples drawn without replacement with `seed` (the run seed when unset); the
id is the expression itself (`arithmetic-37+45`), so it is stable across calls, seeds and runs.
The held-out split (`load_eval_problems`) is `eval_problems` other triples, drawn with the same
seed from those the training draw left out: disjoint from the training problems by construction.

Scoring (the completion text excludes the end-of-sequence token; surrounding whitespace is
ignored): empty -> `no_answer`; not an integer -> `unparsable`; exactly the answer's digits ->
`correct`; another integer (leading zeros included) -> `wrong`. A completion cut at max_tokens
(`finish_reason="length"`) never ended, so it is `wrong` whatever its prefix says. Reward 1/0.
"""

from __future__ import annotations

import random
import re
from typing import Literal

from pydantic import Field, model_validator

from stream_rl.contracts import Problem, Verdict
from stream_rl.errors import ConfigError, TaskError
from stream_rl.tasks.base import FINISH_LENGTH, Scored, Task, TaskParams, register_task

Op = Literal["+", "-", "*"]
_INTEGER = re.compile(r"-?[0-9]+")


def _default_ops() -> list[Op]:
    return ["+"]


class ArithmeticParams(TaskParams):
    min_operand: int = Field(0, ge=0)
    """Smallest operand."""
    max_operand: int = Field(99, ge=0)
    """Largest operand (inclusive)."""
    ops: list[Op] = Field(default_factory=_default_ops, min_length=1)
    """Operators to draw from (`+`, `-`, `*`)."""
    num_problems: int = Field(1000, ge=1)
    """Distinct problems to generate (at most the number of operand/operator triples)."""
    seed: int | None = None
    """Seed of the problem draw; None: the run seed given to `load_problems`."""
    eval_problems: int = Field(200, ge=1)
    """Size of the held-out split: distinct triples outside the training problems."""

    @model_validator(mode="after")
    def _check(self) -> ArithmeticParams:
        if self.max_operand < self.min_operand:
            raise ValueError("max_operand must be >= min_operand")
        if len(set(self.ops)) != len(self.ops):
            raise ValueError("ops lists an operator twice")
        return self


def evaluate(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    return a * b


def score_arithmetic(answer: str | None, completion: str, finish_reason: str = "stop") -> Scored:
    """Verdict and 1/0 reward of one completion against the answer's digits (plain function)."""
    text = completion.strip()
    if not text:
        return Scored(Verdict.NO_ANSWER, 0.0, "empty completion")
    if not _INTEGER.fullmatch(text):
        return Scored(Verdict.UNPARSABLE, 0.0, f"not an integer: {text[:40]!r}")
    if finish_reason == FINISH_LENGTH:
        return Scored(Verdict.WRONG, 0.0, "cut at max_tokens: no end of sequence")
    if text == answer:
        return Scored(Verdict.CORRECT, 1.0, "")
    return Scored(Verdict.WRONG, 0.0, f"expected {answer}, got {text}")


@register_task("arithmetic")
class ArithmeticTask(Task):
    Params = ArithmeticParams
    params: ArithmeticParams

    def _draw(self, seed: int) -> tuple[list[int], random.Random, int]:
        """The training triples' indices, the generator after the draw, and the triple count."""
        p = self.params
        span = p.max_operand - p.min_operand + 1
        total = len(p.ops) * span * span
        if p.num_problems > total:
            raise ConfigError(
                f"task.params.num_problems: {p.num_problems} exceeds the {total} distinct problems "
                f"of operands {p.min_operand}..{p.max_operand} with ops {p.ops}"
            )
        rng = random.Random(p.seed if p.seed is not None else seed)
        # range() is sampled without being materialised: cheap for large operand ranges.
        return rng.sample(range(total), p.num_problems), rng, total

    def load_problems(self, run_id: str, seed: int) -> list[Problem]:
        return self._problems(run_id, self._draw(seed)[0])

    def load_eval_problems(self, run_id: str, seed: int) -> list[Problem]:
        p = self.params
        train, rng, total = self._draw(seed)
        if p.num_problems + p.eval_problems > total:
            raise ConfigError(
                f"task.params.eval_problems: {p.eval_problems} held-out problems do not fit beside the "
                f"{p.num_problems} training problems among {total} distinct ones"
            )
        taken = set(train)
        held_out: list[int] = []
        while len(held_out) < p.eval_problems:  # the complement is at least eval_problems large
            index = rng.randrange(total)
            if index not in taken:
                taken.add(index)
                held_out.append(index)
        return self._problems(run_id, held_out)

    def _problems(self, run_id: str, indices: list[int]) -> list[Problem]:
        p = self.params
        span = p.max_operand - p.min_operand + 1
        problems = []
        for index in indices:
            op_index, rest = divmod(index, span * span)
            a, b = (x + p.min_operand for x in divmod(rest, span))
            op = p.ops[op_index]
            expression = f"{a}{op}{b}="
            problems.append(
                self.make_problem(
                    run_id,
                    problem_id=f"arithmetic-{a}{op}{b}",
                    user_content=expression,
                    answer=str(evaluate(a, op, b)),
                    metadata={"op": op, "a": str(a), "b": str(b)},
                )
            )
        return problems

    def score(self, problem: Problem, completion: str, *, finish_reason: str = "stop") -> Scored:
        return score_arithmetic(problem.answer, completion, finish_reason)

    @staticmethod
    def format_example(problem: Problem) -> str:
        """The ideal completion (without the end-of-sequence token), for supervised warm starts."""
        if problem.answer is None:
            raise TaskError(f"problem {problem.problem_id} has no answer")
        return problem.answer
