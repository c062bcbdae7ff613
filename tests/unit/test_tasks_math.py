"""The math task: boxed-answer extraction, math-verify verdicts, deadlines, problem files, rewards."""

import json
import signal
import threading

import pytest

from stream_rl.contracts import Verdict
from stream_rl.errors import ConfigError, TaskError
from stream_rl.tasks import get_task
from stream_rl.tasks.boxed import Boxed, _Deadline, check_boxed_answer, deadline, last_boxed

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "text,want",
    [
        ("so \\boxed{42}.", Boxed("42", True)),
        ("\\boxed{1} then \\boxed{2}", Boxed("2", True)),
        ("\\boxed{\\frac{1}{2}}", Boxed("\\frac{1}{2}", True)),
        ("\\boxed{\\{1, 2\\}} done", Boxed("\\{1, 2\\}", True)),
        ("\\boxed{a{b{c}}d} tail}", Boxed("a{b{c}}d", True)),
        ("\\boxed{}", Boxed("", True)),
        ("\\boxed{\\frac{1}{2}", Boxed("\\frac{1}{2}", False)),
        ("no box here", None),
        ("\\boxed 5", None),
    ],
)
def test_last_boxed(text, want):
    assert last_boxed(text) == want


VERDICT_TABLE = [
    # (gold, completion, verdict)
    ("42", "The answer is \\boxed{42}.", Verdict.CORRECT),
    ("42", "First \\boxed{41}, no wait: \\boxed{42}", Verdict.CORRECT),
    ("42", "\\boxed{42} but finally \\boxed{41}", Verdict.WRONG),
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{2}}", Verdict.CORRECT),
    ("\\frac{1}{2}", "\\boxed{0.5}", Verdict.CORRECT),
    ("1/2", "\\boxed{\\dfrac{1}{2}}", Verdict.CORRECT),
    ("\\frac{1}{3}", "\\boxed{\\frac{1}{2}}", Verdict.WRONG),
    ("\\frac{\\sqrt{3}}{2}", "\\boxed{\\frac{\\sqrt{3}}{2}}", Verdict.CORRECT),
    ("x^2+1", "\\boxed{1+x^{2}}", Verdict.CORRECT),
    ("\\{1,2\\}", "\\boxed{\\{2, 1\\}}", Verdict.CORRECT),
    ("$\\frac12$", "\\boxed{\\frac{1}{2}}", Verdict.CORRECT),
    ("3", "\\boxed{4}", Verdict.WRONG),
    ("3", "The answer is 3.", Verdict.NO_ANSWER),
    ("3", "", Verdict.NO_ANSWER),
    ("3", "\\boxed{}", Verdict.UNPARSABLE),
    ("3", "\\boxed{   }", Verdict.UNPARSABLE),
    ("3", "\\boxed{\\frac{1}{2}", Verdict.UNPARSABLE),
    ("3", "\\boxed{@@@ ???}", Verdict.UNPARSABLE),
    ("3", "\\boxed{" + "1" * 1001 + "}", Verdict.UNPARSABLE),
    ("@@@", "\\boxed{3}", Verdict.ERROR),
]


@pytest.mark.parametrize("gold,completion,verdict", VERDICT_TABLE)
def test_verdicts(gold, completion, verdict):
    # The verdicts, not the deadline (tested below): math-verify's first call in a process costs
    # seconds of CPU, more than the default 1 s on a loaded machine (xdist workers beside it).
    got, detail = check_boxed_answer(gold, completion, timeout_s=30.0)
    assert got is verdict, detail


def test_deadline_interrupts_and_restores_the_signal_state():
    # pytest-timeout may have armed its own SIGALRM timer for this test: it must survive.
    before_handler = signal.getsignal(signal.SIGALRM)
    before_left, _ = signal.getitimer(signal.ITIMER_REAL)
    with pytest.raises(_Deadline), deadline(0.02) as armed:
        assert armed
        while True:
            pass
    assert signal.getsignal(signal.SIGALRM) is before_handler
    left, _ = signal.getitimer(signal.ITIMER_REAL)
    assert (left == 0.0) if before_left == 0.0 else (before_left - 5.0 < left <= before_left)


def test_deadline_restores_a_timer_armed_by_the_caller():
    old = signal.signal(signal.SIGALRM, lambda *_: None)
    old_timer = signal.setitimer(signal.ITIMER_REAL, 0)
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        with deadline(5.0):
            pass
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 25.0 < left <= 30.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, *old_timer)
        signal.signal(signal.SIGALRM, old)


def test_check_over_the_deadline_is_a_timeout_verdict():
    check_boxed_answer("1", "\\boxed{1}")  # warm math-verify up, so the deadline hits the check itself
    verdict, detail = check_boxed_answer("x^2+1", "\\boxed{1+x^{2}}", timeout_s=1e-6)
    assert verdict is Verdict.TIMEOUT and "longer than" in detail


def test_check_off_the_main_thread_runs_without_a_deadline():
    results = []
    worker = threading.Thread(
        target=lambda: results.append(check_boxed_answer("2", "\\boxed{2}", timeout_s=1e-6))
    )
    worker.start()
    worker.join(timeout=60)
    assert results and results[0][0] is Verdict.CORRECT


# ---------------------------------------------------------------- problem files and rewards

ROWS = [
    {"problem": "What is 1+1?", "answer": "2", "id": "p-a"},
    {"question": "Half of 1?", "answer": "\\frac{1}{2}"},
    {"problem": "Seven?", "answer": 7},
]


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    return path


def test_loads_jsonl_with_stable_unique_ids(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    task = get_task("math", {"path": str(path)})
    problems = task.load_problems("run", 0)
    assert [p.answer for p in problems] == ["2", "\\frac{1}{2}", "7"]
    assert len({p.problem_id for p in problems}) == 3
    assert problems[0].problem_id.startswith("math-000000-")
    assert problems[0].metadata == {"source": "train.jsonl", "row": "0", "source_id": "p-a"}
    assert "Half of 1?" in problems[1].prompt[-1].content and "\\boxed{}" in problems[1].prompt[-1].content
    assert [p.problem_id for p in task.load_problems("run", 5)] == [p.problem_id for p in problems]
    # Duplicated rows still get distinct ids (the index is part of the id).
    dup = get_task("math", {"path": str(write_jsonl(tmp_path / "dup.jsonl", [ROWS[0], ROWS[0]]))})
    assert len({p.problem_id for p in dup.load_problems("run", 0)}) == 2


def test_loads_json_and_parquet(tmp_path):
    import pyarrow as pa  # a dependency (the math task reads Parquet): a plain import, never a skip
    import pyarrow.parquet as pq

    (tmp_path / "p.json").write_text(json.dumps(ROWS[:1]))
    pq.write_table(
        pa.Table.from_pylist([{"problem": "1+1?", "answer": "2"}, {"problem": "2+2?", "answer": "4"}]),
        tmp_path / "p.parquet",
    )
    json_task = get_task(
        "math", {"path": str(tmp_path / "p.json"), "prompt_template": "Q: {problem} {unchanged}"}
    )
    (problem,) = json_task.load_problems("run", 0)
    assert problem.prompt[-1].content == "Q: What is 1+1? {unchanged}"
    parquet = get_task("math", {"path": str(tmp_path / "p.parquet")}).load_problems("run", 0)
    assert [p.answer for p in parquet] == ["2", "4"]


def test_bad_problem_files_are_clear_errors(tmp_path):
    with pytest.raises(TaskError, match="no such file"):
        get_task("math", {"path": str(tmp_path / "missing.jsonl")}).load_problems("r", 0)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"problem": "x?"}])
    with pytest.raises(TaskError, match=r"row 0: needs an `answer`"):
        get_task("math", {"path": str(bad)}).load_problems("r", 0)
    (tmp_path / "broken.jsonl").write_text('{"problem": "x", "answer": 1}\n{oops\n')
    with pytest.raises(TaskError, match=r"broken.jsonl:2: not valid JSON"):
        get_task("math", {"path": str(tmp_path / "broken.jsonl")}).load_problems("r", 0)
    (tmp_path / "p.csv").write_text("problem,answer\n")
    with pytest.raises(TaskError, match="unsupported file type"):
        get_task("math", {"path": str(tmp_path / "p.csv")}).load_problems("r", 0)
    with pytest.raises(ConfigError, match=r"task.params.prompt_template: .*must contain \{problem\}"):
        get_task("math", {"path": "x.jsonl", "prompt_template": "no placeholder"})


def test_reward_tables(tmp_path):
    path = str(write_jsonl(tmp_path / "t.jsonl", ROWS))
    pure = get_task("math", {"path": path})
    base = get_task("math", {"path": path, "rewards": "base"})
    problem = pure.load_problems("r", 0)[0]
    cases = [
        ("\\boxed{2}", "stop", 1.0, 1.0),
        ("\\boxed{2}", "length", 1.0, -1.0),
        ("\\boxed{3}", "stop", 0.0, -0.5),
        ("\\boxed{3}", "length", 0.0, -1.0),
        ("two", "stop", 0.0, -1.0),
        ("\\boxed{}", "stop", 0.0, -1.0),
    ]
    for completion, finish, want_pure, want_base in cases:
        assert pure.score(problem, completion, finish_reason=finish).reward == want_pure
        assert base.score(problem, completion, finish_reason=finish).reward == want_base
    table = {k: 0.25 for k in ("correct_answer", "wrong_answer", "no_answer", "unparsable")}
    custom = {
        f"{k}_{f}": v + (1.0 if k == "correct_answer" and f == "finished" else 0.0)
        for k, v in table.items()
        for f in ("finished", "not_finished")
    }
    task = get_task("math", {"path": path, "rewards": custom})
    assert task.score(problem, "\\boxed{2}").reward == 1.25
    assert task.score(problem, "\\boxed{5}").reward == 0.25
    assert base.reward(Verdict.TIMEOUT) == -1.0 and pure.reward(Verdict.ERROR) == 0.0
    with pytest.raises(ConfigError, match="task.params.rewards"):
        get_task("math", {"path": path, "rewards": "generous"})


def test_scoring_runs_in_a_worker_process(tmp_path):
    # The verifier stage scores in a process pool: the task's bound `score` must pickle, and the
    # deadline is armed there (a worker runs tasks in its main thread).
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    task = get_task("math", {"path": str(write_jsonl(tmp_path / "t.jsonl", ROWS)), "verify_timeout_s": 1e-6})
    problem = task.load_problems("r", 0)[0]
    check_boxed_answer("1", "\\boxed{1}")  # imported before the fork: the worker starts warm
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        scored = pool.submit(task.score, problem, "\\boxed{2}").result(timeout=60)
    assert scored.verdict is Verdict.TIMEOUT
