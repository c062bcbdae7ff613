"""Task registry, params validation and the arithmetic toy."""

import pickle

import pytest

from stream_rl.config import load_config
from stream_rl.contracts import Verdict
from stream_rl.errors import ConfigError, TaskError
from stream_rl.tasks import TASKS, Task, get_task, register_task
from stream_rl.tasks.arithmetic import ArithmeticTask, score_arithmetic

pytestmark = pytest.mark.unit


def test_builtin_tasks_are_registered():
    assert {"arithmetic", "math", "guessing"} <= set(TASKS)
    assert TASKS["guessing"].multi_turn and not TASKS["arithmetic"].multi_turn


def test_default_run_config_builds_its_task():
    config = load_config()
    task = get_task(config.task.name, config.task.params, config.task.system_prompt)
    assert isinstance(task, ArithmeticTask)


def test_unknown_task_and_bad_params_name_the_key():
    with pytest.raises(
        ConfigError, match=r"task.name: unknown task 'algebra' \(registered: arithmetic, guessing, math"
    ):
        get_task("algebra", {})
    with pytest.raises(ConfigError, match=r"task.params.max_opernd: unknown key for task 'arithmetic'"):
        get_task("arithmetic", {"max_opernd": 5})
    with pytest.raises(ConfigError, match=r"task.params.ops.0: .*\(got '/'\)"):
        get_task("arithmetic", {"ops": ["/"]})
    with pytest.raises(ConfigError, match=r"task.params.path: Field required"):
        get_task("math", {})
    with pytest.raises(ConfigError, match=r"task.params: .*max_operand must be >= min_operand"):
        get_task("arithmetic", {"min_operand": 5, "max_operand": 2})


def test_registering_a_name_twice_fails():
    with pytest.raises(TaskError, match="registered twice"):

        @register_task("arithmetic")
        class Other(Task):
            pass


def test_tasks_and_their_score_pickle():
    task = get_task("arithmetic", {"max_operand": 9, "num_problems": 3})
    problem = task.load_problems("run", 0)[0]
    clone = pickle.loads(pickle.dumps(task))
    assert clone.params == task.params
    score = pickle.loads(pickle.dumps(task.score))
    assert score(problem, problem.answer) == task.score(problem, problem.answer)


def test_system_prompt_is_prepended():
    task = get_task("arithmetic", {"num_problems": 1}, system_prompt="Add.")
    (problem,) = task.load_problems("run", 0)
    assert [m.role for m in problem.prompt] == ["system", "user"]
    assert problem.prompt[0].content == "Add."


# ---------------------------------------------------------------- arithmetic


def test_arithmetic_problems_are_minimal_distinct_and_stable():
    task = get_task("arithmetic", {"max_operand": 99, "num_problems": 200})
    problems = task.load_problems("run", 7)
    assert len({p.problem_id for p in problems}) == 200
    for p in problems:
        p.validate()
        assert p.run_id == "run" and p.epoch == 0 and p.task == "arithmetic"
        (message,) = p.prompt
        a, b = message.content.rstrip("=").split("+")
        assert message.content.endswith("=") and 0 <= int(a) <= 99 and 0 <= int(b) <= 99
        assert p.answer == str(int(a) + int(b))
        assert p.problem_id == f"arithmetic-{a}+{b}"
    again = task.load_problems("run", 7)
    assert [p.problem_id for p in again] == [p.problem_id for p in problems]
    other_seed = task.load_problems("run", 8)
    assert [p.problem_id for p in other_seed] != [p.problem_id for p in problems]
    # The task's own seed overrides the run seed.
    fixed = get_task("arithmetic", {"num_problems": 20, "seed": 3})
    assert [p.problem_id for p in fixed.load_problems("r", 1)] == [
        p.problem_id for p in fixed.load_problems("r", 2)
    ]


def test_arithmetic_knobs():
    task = get_task("arithmetic", {"min_operand": 2, "max_operand": 3, "ops": ["-", "*"], "num_problems": 8})
    problems = task.load_problems("run", 0)
    assert sorted(p.prompt[0].content for p in problems) == sorted(
        f"{a}{op}{b}=" for op in "-*" for a in (2, 3) for b in (2, 3)
    )
    answers = {p.prompt[0].content: p.answer for p in problems}
    assert answers["2-3="] == "-1" and answers["3*3="] == "9"
    with pytest.raises(ConfigError, match="num_problems: 9 exceeds the 8 distinct problems"):
        get_task(
            "arithmetic", {"min_operand": 2, "max_operand": 3, "ops": ["-", "*"], "num_problems": 9}
        ).load_problems("r", 0)


@pytest.mark.parametrize(
    "completion,finish,verdict",
    [
        ("82", "stop", Verdict.CORRECT),
        (" 82\n", "stop", Verdict.CORRECT),
        ("83", "stop", Verdict.WRONG),
        ("082", "stop", Verdict.WRONG),
        ("82", "length", Verdict.WRONG),
        ("", "stop", Verdict.NO_ANSWER),
        ("  ", "length", Verdict.NO_ANSWER),
        ("82+1", "stop", Verdict.UNPARSABLE),
        ("eighty-two", "stop", Verdict.UNPARSABLE),
    ],
)
def test_arithmetic_scoring(completion, finish, verdict):
    scored = score_arithmetic("82", completion, finish)
    assert scored.verdict is verdict
    assert scored.reward == (1.0 if verdict is Verdict.CORRECT else 0.0)


def test_arithmetic_negative_answers_and_format_example():
    task = get_task("arithmetic", {"min_operand": 0, "max_operand": 1, "ops": ["-"], "num_problems": 4})
    problem = next(p for p in task.load_problems("r", 0) if p.prompt[0].content == "0-1=")
    assert ArithmeticTask.format_example(problem) == "-1"
    assert task.score(problem, "-1").verdict is Verdict.CORRECT
    assert task.reward(Verdict.TIMEOUT) == 0.0 and task.reward(Verdict.CORRECT) == 1.0
