"""`progression`: count down by a step, term by term: a long answer checked exactly.

The long-sequence task (docs/performance.md "Performance": PipelineRL's regime). The user message is
`count down by 1 from 117` and the ideal completion every term from the first down to the last
that is not negative, zero-padded to `width` digits and separated by single spaces, then end of
sequence: `117 116 115 ... 002 001 000`. Each term is a subtraction (with borrows) from the one
before it, so a completion is right only if each of its tens to hundreds of steps is: the
reward is all or nothing, as for a reasoning trace. Everything a term needs sits a fixed
distance back (the previous term, or for the first one the prompt's last digits; the stop rule
"the last term is below the step"), which a ~0.5M-parameter model learns in minutes on a CPU
(with the start number earlier in the prompt, `count down from 117 by 1`, the tiny preset had
not learned to copy it after 350 steps: the first term was right 45% of the time, greedy). Other steps (`steps: [1, 2, 3]`) make the
model infer the step from the prompt or the last two terms: measured, the tiny preset had not
learned that after 200 warm-start steps (units digit right 19% of the time, greedy), hence the
default of 1.

Lengths are drawn per problem and heavy-tailed, as reasoning traces are: the number of terms n
is a log-normal draw (median `median_terms`, log-scale spread `sigma`) clipped to
`[min_terms, max_terms]` and to what `width` digits hold; the step d is drawn from `steps`, the
last term r from `[0, d)`, and the first term is `r + (n - 1) * d`. A completion has
`(width + 1) * n` tokens with the byte-level tokenizers of `make-model` (its end-of-sequence
token included). With the defaults seed 0's 2,000 problems have completions of 16 to 1,024
tokens: p10 28, median 84, p90 252, p99 676 (p99 / median 8.0), mean 122;
`tests/unit/test_tasks_progression.py` pins these quantiles.

Problems are independent draws (two may be alike, as two draws of a generator may): the id is
the draw's index and content (`progression-00042-117-3`), stable across calls for a seed.
Draws use `seed` (the run seed when unset).

Scoring (the completion text excludes the end-of-sequence token; surrounding whitespace is
ignored): empty -> `no_answer`; cut at max_tokens (`finish_reason="length"`) -> `wrong` whatever
it says, it never ended; anything but integers separated by single spaces -> `unparsable`;
exactly the expected terms -> `correct`; otherwise `wrong`, the detail naming the first wrong
term. Reward 1/0.
"""

from __future__ import annotations

import math
import random
import re

from pydantic import Field, model_validator

from stream_rl.contracts import Problem, Verdict
from stream_rl.errors import TaskError
from stream_rl.tasks.base import FINISH_LENGTH, Scored, Task, TaskParams, WarmStartDefaults, register_task

_TERMS = re.compile(r"-?[0-9]+( -?[0-9]+)*")


def _default_steps() -> list[int]:
    return [1]


class ProgressionParams(TaskParams):
    num_problems: int = Field(2000, ge=1)
    """Problems to draw."""
    steps: list[int] = Field(default_factory=_default_steps, min_length=1)
    """Steps to draw from (positive integers)."""
    width: int = Field(3, ge=1, le=6)
    """Digits of every term (zero-padded)."""
    median_terms: float = Field(21.0, gt=0)
    """Median of the log-normal draw of the number of terms."""
    sigma: float = Field(0.9, ge=0)
    """Log-scale spread of that draw (0: every problem has `median_terms` terms)."""
    min_terms: int = Field(4, ge=1)
    """Fewest terms of a problem."""
    max_terms: int = Field(256, ge=1)
    """Most terms of a problem (completions of at most `(width + 1) * max_terms` tokens; keep
    `actor.sampling.max_tokens` at or above that)."""
    seed: int | None = None
    """Seed of the problem draw; None: the run seed given to `load_problems`."""

    @model_validator(mode="after")
    def _check(self) -> ProgressionParams:
        if self.max_terms < self.min_terms:
            raise ValueError("max_terms must be >= min_terms")
        if any(s < 1 for s in self.steps):
            raise ValueError("steps must be positive integers")
        if len(set(self.steps)) != len(self.steps):
            raise ValueError("steps lists a value twice")
        if (self.min_terms - 1) * max(self.steps) + max(self.steps) > 10**self.width:
            raise ValueError(f"min_terms terms of step {max(self.steps)} do not fit in {self.width} digits")
        return self


def terms_of(first: int, step: int) -> list[int]:
    """The progression from `first` down by `step` to its last non-negative term."""
    return list(range(first, -1, -step))


def format_terms(terms: list[int], width: int) -> str:
    return " ".join(f"{t:0{width}d}" for t in terms)


def score_progression(answer: str | None, completion: str, finish_reason: str = "stop") -> Scored:
    """Verdict and 1/0 reward of one completion against the expected terms (plain function)."""
    text = completion.strip()
    if not text:
        return Scored(Verdict.NO_ANSWER, 0.0, "empty completion")
    if finish_reason == FINISH_LENGTH:
        return Scored(Verdict.WRONG, 0.0, "cut at max_tokens: no end of sequence")
    if not _TERMS.fullmatch(text):
        return Scored(Verdict.UNPARSABLE, 0.0, f"not integers separated by single spaces: {text[:40]!r}")
    if answer is None:
        raise TaskError("progression problem without an answer")
    if text == answer:
        return Scored(Verdict.CORRECT, 1.0, "")
    got, expected = text.split(" "), answer.split(" ")
    for i, (g, e) in enumerate(zip(got, expected, strict=False)):
        if g != e:
            return Scored(Verdict.WRONG, 0.0, f"term {i + 1}: expected {e}, got {g}")
    return Scored(Verdict.WRONG, 0.0, f"{len(got)} terms, expected {len(expected)}")


@register_task("progression")
class ProgressionTask(Task):
    Params = ProgressionParams
    params: ProgressionParams
    # Label smoothing spreads a share of every token's probability over the vocabulary; over
    # completions of ~84 tokens (median) a small share already makes most samples wrong
    # somewhere. A cosine decay: at a constant 3e-3 the loss climbed back after ~250 steps
    # (0.23 -> 0.28 at 500) and the model never learned to stop. Measured with the tiny preset,
    # 600 steps, 5.5 min on a quiet core: loss 0.215, accuracy on 64 problems 0.50 sampled and
    # 0.875 greedy; in a long-cpu run (max_terms 160) the first step scores 0.14-0.17.
    warm_start = WarmStartDefaults(
        steps=600, batch_tokens=4096, lr=3e-3, label_smoothing=0.02, min_lr_ratio=0.1
    )

    def draw_terms(self, rng: random.Random) -> int:
        p = self.params
        n = round(math.exp(rng.gauss(math.log(p.median_terms), p.sigma))) if p.sigma else p.median_terms
        return int(min(max(n, p.min_terms), p.max_terms))

    def load_problems(self, run_id: str, seed: int) -> list[Problem]:
        p = self.params
        rng = random.Random(p.seed if p.seed is not None else seed)
        problems = []
        for index in range(p.num_problems):
            step = rng.choice(p.steps)
            last = rng.randrange(step)
            terms = min(self.draw_terms(rng), (10**p.width - 1 - last) // step + 1)
            first = last + (terms - 1) * step
            problems.append(
                self.make_problem(
                    run_id,
                    problem_id=f"progression-{index:05d}-{first}-{step}",
                    user_content=f"count down by {step} from {first:0{p.width}d}",
                    answer=format_terms(terms_of(first, step), p.width),
                    metadata={"first": str(first), "step": str(step), "terms": str(terms)},
                )
            )
        return problems

    def score(self, problem: Problem, completion: str, *, finish_reason: str = "stop") -> Scored:
        return score_progression(problem.answer, completion, finish_reason)

    @staticmethod
    def format_example(problem: Problem) -> str:
        """The ideal completion (without the end-of-sequence token), for supervised warm starts."""
        if problem.answer is None:
            raise TaskError(f"problem {problem.problem_id} has no answer")
        return problem.answer
