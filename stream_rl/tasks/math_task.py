"""`math`: problems from a local JSONL, JSON or Parquet file; answers in the last `\\boxed{}`.

Params (`task.params`): `path` (required; `.jsonl`, `.json` holding a list of objects, or
`.parquet`), `prompt_template`, `rewards`, `strict`, `verify_timeout_s`, `max_answer_chars`.
Each row needs the problem text in `problem` (or `question`) and the reference answer in
`answer` (a string or a number). Rows are read in file order; a row's id is its index plus a hash
of its content (`math-000042-1a2b3c4d`): unique, and stable across calls while the file is
unchanged. The row's own `id` field, if any, is kept in the metadata.

Held-out split (`load_eval_problems`): the rows of `eval_path` (e.g. MATH-500), or else the
`eval_size` rows of `path` whose content hash is smallest (then left out of training). Rows
whose problem and answer also appear among the training rows are dropped from it, so the split
is disjoint from training whichever way it is given.

Scoring: `stream_rl.tasks.boxed.check_boxed_answer` (verdicts `correct`, `wrong`, `no_answer`,
`unparsable`, and `error`/`timeout`), then a reward table over (verdict, finished), as
PipelineRL's `rewards` option: `pure_success` (default) gives 1 for `correct` and 0 otherwise;
`base` gives +1 for correct and finished, -0.5 for wrong and finished, -1 otherwise; or give the
eight entries explicitly. `error` and `timeout` get the `unparsable` entries.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from stream_rl.contracts import Problem, Verdict
from stream_rl.errors import TaskError
from stream_rl.tasks.base import FINISH_LENGTH, Scored, Task, TaskParams, register_task
from stream_rl.tasks.boxed import check_boxed_answer

DEFAULT_TEMPLATE = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{}."
PROBLEM_FIELDS = ("problem", "question")


class RewardTable(TaskParams):
    """Reward per (verdict, finished); `finished` means the completion did not hit max_tokens."""

    correct_answer_finished: float
    correct_answer_not_finished: float
    wrong_answer_finished: float
    wrong_answer_not_finished: float
    no_answer_finished: float
    no_answer_not_finished: float
    unparsable_finished: float
    unparsable_not_finished: float

    def lookup(self, verdict: Verdict, finished: bool) -> float:
        status = {
            Verdict.CORRECT: "correct_answer",
            Verdict.WRONG: "wrong_answer",
            Verdict.NO_ANSWER: "no_answer",
        }.get(verdict, "unparsable")
        value: float = getattr(self, f"{status}_{'finished' if finished else 'not_finished'}")
        return value


REWARD_PRESETS: dict[str, RewardTable] = {
    "pure_success": RewardTable(
        correct_answer_finished=1.0,
        correct_answer_not_finished=1.0,
        wrong_answer_finished=0.0,
        wrong_answer_not_finished=0.0,
        no_answer_finished=0.0,
        no_answer_not_finished=0.0,
        unparsable_finished=0.0,
        unparsable_not_finished=0.0,
    ),
    "base": RewardTable(
        correct_answer_finished=1.0,
        correct_answer_not_finished=-1.0,
        wrong_answer_finished=-0.5,
        wrong_answer_not_finished=-1.0,
        no_answer_finished=-1.0,
        no_answer_not_finished=-1.0,
        unparsable_finished=-1.0,
        unparsable_not_finished=-1.0,
    ),
}


class MathParams(TaskParams):
    path: str
    """Problem file: `.jsonl`, `.json` (a list of objects) or `.parquet`; rows with `problem` or
    `question`, and `answer`."""
    prompt_template: str = DEFAULT_TEMPLATE
    """User message; `{problem}` is replaced by the problem text (other braces are literal)."""
    rewards: Literal["pure_success", "base"] | RewardTable = "pure_success"
    """Reward table: a preset name or the eight `<verdict>_(not_)finished` entries."""
    strict: bool = True
    """math-verify strict mode (variables matter; sets and tuples differ)."""
    verify_timeout_s: float = Field(1.0, gt=0)
    """Deadline of one answer check (parses and comparison)."""
    max_answer_chars: int = Field(1000, ge=1)
    """A longer boxed answer is `unparsable`."""
    eval_path: str | None = None
    """Held-out problems (same formats as `path`), e.g. MATH-500."""
    eval_size: int = Field(0, ge=0)
    """Without `eval_path`: hold out this many rows of `path` (the smallest content hashes)."""

    @field_validator("prompt_template")
    @classmethod
    def _has_placeholder(cls, value: str) -> str:
        if "{problem}" not in value:
            raise ValueError("must contain {problem}")
        return value

    def reward_table(self) -> RewardTable:
        return REWARD_PRESETS[self.rewards] if isinstance(self.rewards, str) else self.rewards


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSONL, JSON (list) or Parquet file, as dicts."""
    if not path.is_file():
        raise TaskError(f"task.params.path: no such file {path}")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:  # a dependency, but keep the message useful in trimmed installs
            raise TaskError("reading Parquet needs pyarrow (pip install pyarrow)") from exc
        rows: list[dict[str, Any]] = pq.read_table(path).to_pylist()
        return rows
    text = path.read_text(encoding="utf-8")
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TaskError(f"{path}: not valid JSON: {exc}") from exc
        if not isinstance(data, list):
            raise TaskError(f"{path}: expected a JSON list of objects")
        return data
    if suffix != ".jsonl":
        raise TaskError(f"{path}: unsupported file type {suffix!r} (use .jsonl, .json or .parquet)")
    out = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise TaskError(f"{path}:{lineno}: not valid JSON: {exc}") from exc
    return out


def _row_problem(path: Path, index: int, row: Any) -> tuple[str, str]:
    where = f"{path} row {index}"
    if not isinstance(row, dict):
        raise TaskError(f"{where}: expected an object, got {type(row).__name__}")
    text = next((row[k] for k in PROBLEM_FIELDS if row.get(k) is not None), None)
    if not isinstance(text, str) or not text.strip():
        raise TaskError(f"{where}: needs a non-empty `problem` (or `question`) string")
    answer = row.get("answer")
    if isinstance(answer, bool) or not isinstance(answer, str | int | float) or not str(answer).strip():
        raise TaskError(f"{where}: needs an `answer` (string or number)")
    return text, str(answer).strip()


def score_math(
    answer: str | None,
    completion: str,
    finish_reason: str,
    params: MathParams,
) -> Scored:
    """Verdict and reward of one completion (a plain function: picklable, runs in worker processes)."""
    if answer is None:
        return Scored(Verdict.ERROR, 0.0, "problem has no reference answer")
    verdict, detail = check_boxed_answer(
        answer,
        completion,
        strict=params.strict,
        timeout_s=params.verify_timeout_s,
        max_chars=params.max_answer_chars,
    )
    return Scored(verdict, params.reward_table().lookup(verdict, finish_reason != FINISH_LENGTH), detail)


def _with_run(problem: Problem, run_id: str) -> Problem:
    problem.run_id = run_id
    return problem


@register_task("math")
class MathTask(Task):
    Params = MathParams
    params: MathParams

    def _rows(self, path: Path, prefix: str) -> list[tuple[str, Problem]]:
        """(content digest, problem) of every row of `path`."""
        out = []
        for index, row in enumerate(read_rows(path)):
            text, answer = _row_problem(path, index, row)
            digest = hashlib.sha1(f"{text}\x00{answer}".encode()).hexdigest()
            metadata = {"source": path.name, "row": str(index)}
            if row.get("id") is not None:
                metadata["source_id"] = str(row["id"])
            problem = self.make_problem(
                "",
                problem_id=f"{prefix}-{index:06d}-{digest[:8]}",
                user_content=self.params.prompt_template.replace("{problem}", text),
                answer=answer,
                metadata=metadata,
            )
            out.append((digest, problem))
        if not out:
            raise TaskError(f"{path}: no problems")
        return out

    def _held_out(self, rows: list[tuple[str, Problem]]) -> set[str]:
        """Digests of the rows of `path` held out for evaluation (without `eval_path`)."""
        if self.params.eval_path is not None or not self.params.eval_size:
            return set()
        return {d for d, _ in sorted(rows, key=lambda r: r[0])[: self.params.eval_size]}

    def load_problems(self, run_id: str, seed: int) -> list[Problem]:
        rows = self._rows(Path(self.params.path), "math")
        held = self._held_out(rows)
        problems = [_with_run(p, run_id) for d, p in rows if d not in held]
        if not problems:
            raise TaskError(f"{self.params.path}: no training problems left after eval_size")
        return problems

    @property
    def eval_split(self) -> str:
        return Path(self.params.eval_path).stem if self.params.eval_path else "held-out"

    def load_eval_problems(self, run_id: str, seed: int) -> list[Problem]:
        p = self.params
        train = self._rows(Path(p.path), "math")
        if p.eval_path is None:
            if not p.eval_size:
                raise TaskError(
                    "task math has no held-out split: set task.params.eval_path (a problem file) or "
                    "task.params.eval_size (rows of task.params.path to hold out)"
                )
            held = self._held_out(train)
            return [_with_run(prob, run_id) for d, prob in train if d in held]
        seen = {d for d, _ in train}
        problems = [
            _with_run(prob, run_id) for d, prob in self._rows(Path(p.eval_path), "math-eval") if d not in seen
        ]
        if not problems:
            raise TaskError(
                f"task.params.eval_path: every problem of {p.eval_path} is also a training problem"
            )
        return problems

    def score(self, problem: Problem, completion: str, *, finish_reason: str = "stop") -> Scored:
        return score_math(problem.answer, completion, finish_reason, self.params)

    def reward(self, verdict: Verdict, finish_reason: str = "stop") -> float:
        return self.params.reward_table().lookup(verdict, finish_reason != FINISH_LENGTH)
