"""Evaluation: due versions, pass@1/pass@k aggregation, off-version token counts, held-out splits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stream_rl.contracts import Verdict, VersionSpan
from stream_rl.stages.evaluation import Outcome, aggregate, count_versions, is_due
from stream_rl.tasks import get_task

pytestmark = pytest.mark.unit


def test_due_versions() -> None:
    assert [v for v in range(8) if is_due(v, 3, final=False)] == [0, 3, 6]
    assert is_due(7, 3, final=True)


def test_off_version_tokens_come_from_the_spans() -> None:
    spans = [VersionSpan(4, 0), VersionSpan(5, 3)]
    assert count_versions(spans, 5, 4) == (5, 2, 4, 5)
    assert count_versions(spans, 5, 4, mask=[True, False, True, False, True]) == (3, 1, 4, 5)
    assert count_versions([], 0, 4) == (0, 0, 4, 4)


def o(pid: str, greedy: bool, ok: bool, tokens: int = 3, off: int = 0) -> Outcome:
    verdict = Verdict.CORRECT if ok else Verdict.WRONG
    return Outcome(pid, greedy, verdict, 1.0 if ok else 0.0, tokens, off, 2, 2 + bool(off))


def test_aggregate_pass_at_1_and_k() -> None:
    outcomes = [
        o("a", True, True), o("b", True, False),
        o("a", False, True), o("a", False, False), o("b", False, False), o("b", False, True, off=3),
    ]  # fmt: skip
    r = aggregate(
        outcomes, run_id="r", version=2, task="t", split="s", num_problems=2, k=2, temperature=1.0,
        evaluator_id="e", started_ms=0,
    )  # fmt: skip
    assert r.pass_at_1 == 0.5 and r.sampled_pass_at_1 == 0.5 and r.pass_at_k == 1.0
    assert r.greedy_correct == ["a"]
    assert r.verdicts == {"correct": 3, "wrong": 3}
    assert r.tokens == 18 and r.off_version_tokens == 3 and r.off_version_token_frac == pytest.approx(1 / 6)
    assert (r.min_token_version, r.max_token_version) == (2, 3)
    r.validate()


def test_greedy_only_has_no_pass_at_k() -> None:
    r = aggregate([o("a", True, True)], run_id="r", version=0, task="t", split="s", num_problems=1, k=4,
                  temperature=1.0, evaluator_id="e", started_ms=0)  # fmt: skip
    assert r.pass_at_1 == 1.0 and r.pass_at_k is None and r.k == 0


def _disjoint(train: list, held: list) -> None:  # type: ignore[type-arg]
    assert held
    assert not {p.problem_id for p in train} & {p.problem_id for p in held}
    prompts = {json.dumps([m.to_dict() for m in p.prompt]) for p in train}
    assert not prompts & {json.dumps([m.to_dict() for m in p.prompt]) for p in held}
    assert len({p.problem_id for p in held}) == len(held)


def test_arithmetic_held_out_split_is_disjoint_and_stable() -> None:
    task = get_task("arithmetic", {"max_operand": 9, "num_problems": 60, "eval_problems": 40})
    train, held = task.load_problems("r", 0), task.load_eval_problems("r", 0)
    _disjoint(train, held)
    assert len(held) == 40 and [p.problem_id for p in held] == [
        p.problem_id for p in task.load_eval_problems("x", 0)
    ]
    # The training draw is unchanged by the held-out split.
    assert [p.problem_id for p in train] == [
        p.problem_id
        for p in get_task("arithmetic", {"max_operand": 9, "num_problems": 60}).load_problems("r", 0)
    ]
    from stream_rl.errors import ConfigError

    with pytest.raises(ConfigError, match="task.params.eval_problems"):
        get_task(
            "arithmetic", {"max_operand": 9, "num_problems": 90, "eval_problems": 20}
        ).load_eval_problems("r", 0)


def test_guessing_held_out_split_is_the_other_parity() -> None:
    task = get_task("guessing", {"max_number": 64, "eval_problems": 10})
    train, held = task.load_problems("r", 0), task.load_eval_problems("r", 0)
    assert task.eval_split == "test" and all(int(p.answer or 0) % 2 == 0 for p in held)
    assert not {p.answer for p in train} & {p.answer for p in held}
    assert not {p.problem_id for p in train} & {p.problem_id for p in held}


def test_math_held_out_rows_leave_training_and_an_eval_file_drops_training_rows(tmp_path: Path) -> None:
    rows = [{"problem": f"What is {i}+1?", "answer": str(i + 1)} for i in range(20)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    task = get_task("math", {"path": str(tmp_path / "train.jsonl"), "eval_size": 5})
    train, held = task.load_problems("r", 0), task.load_eval_problems("r", 0)
    assert len(train) == 15 and len(held) == 5
    _disjoint(train, held)
    (tmp_path / "test.jsonl").write_text(
        "\n".join(json.dumps(r) for r in [rows[0], {"problem": "2*3?", "answer": "6"}])
    )
    task = get_task(
        "math", {"path": str(tmp_path / "train.jsonl"), "eval_path": str(tmp_path / "test.jsonl")}
    )
    held = task.load_eval_problems("r", 0)
    assert [p.answer for p in held] == ["6"] and task.eval_split == "test"
    assert len(task.load_problems("r", 0)) == 20
    from stream_rl.errors import TaskError

    with pytest.raises(TaskError, match="no held-out split"):
        get_task("math", {"path": str(tmp_path / "train.jsonl")}).load_eval_problems("r", 0)
