"""The long-sequence task `progression`: verifier cases, problems, the heavy-tailed length
distribution of a fixed seed, and a warm-start smoke run."""

from __future__ import annotations

import pickle
import statistics
from pathlib import Path

import pytest

from stream_rl.contracts import Verdict
from stream_rl.errors import ConfigError
from stream_rl.tasks import get_task
from stream_rl.tasks.progression import format_terms, score_progression, terms_of

pytestmark = pytest.mark.unit

ANSWER = "014 011 008 005 002"


@pytest.mark.parametrize(
    "completion,finish,verdict,detail",
    [
        ("014 011 008 005 002", "stop", Verdict.CORRECT, ""),
        ("  014 011 008 005 002\n", "stop", Verdict.CORRECT, ""),
        ("014 011 007 005 002", "stop", Verdict.WRONG, "term 3: expected 008, got 007"),
        ("014 011 008 005", "stop", Verdict.WRONG, "4 terms, expected 5"),
        ("014 011 008 005 002 -01", "stop", Verdict.WRONG, "6 terms, expected 5"),
        ("14 11 8 5 2", "stop", Verdict.WRONG, "term 1: expected 014, got 14"),
        ("014 011 008 005 002", "length", Verdict.WRONG, "cut at max_tokens"),
        ("014 011 00", "length", Verdict.WRONG, "cut at max_tokens"),
        ("014 011 008 0x5", "length", Verdict.WRONG, "cut at max_tokens"),
        ("", "stop", Verdict.NO_ANSWER, "empty"),
        ("   ", "length", Verdict.NO_ANSWER, "empty"),
        ("014  011 008 005 002", "stop", Verdict.UNPARSABLE, "single spaces"),
        ("014,011,008,005,002", "stop", Verdict.UNPARSABLE, "single spaces"),
        ("014 011 008 005 002.", "stop", Verdict.UNPARSABLE, "single spaces"),
        ("fourteen", "stop", Verdict.UNPARSABLE, "single spaces"),
    ],
)
def test_scoring(completion: str, finish: str, verdict: Verdict, detail: str) -> None:
    scored = score_progression(ANSWER, completion, finish)
    assert scored.verdict is verdict
    assert detail in scored.detail
    assert scored.reward == (1.0 if verdict is Verdict.CORRECT else 0.0)


def test_problems_are_stable_and_checkable() -> None:
    task = get_task("progression", {"num_problems": 300})
    problems = task.load_problems("run", 7)
    assert len({p.problem_id for p in problems}) == 300
    for i, p in enumerate(problems):
        p.validate()
        (message,) = p.prompt
        first, step = int(p.metadata["first"]), int(p.metadata["step"])
        assert message.content == f"count down by {step} from {first:03d}"
        assert p.answer == format_terms(terms_of(first, step), 3)
        assert 0 <= terms_of(first, step)[-1] < step and len(p.answer.split(" ")) == int(p.metadata["terms"])  # type: ignore[union-attr]
        assert p.problem_id == f"progression-{i:05d}-{first}-{step}"
        assert task.score(p, p.answer).verdict is Verdict.CORRECT  # type: ignore[arg-type]
        assert task.format_example(p) == p.answer  # type: ignore[attr-defined]
    again = task.load_problems("run", 7)
    assert [p.problem_id for p in again] == [p.problem_id for p in problems]
    assert [p.problem_id for p in task.load_problems("run", 8)] != [p.problem_id for p in problems]
    assert pickle.loads(pickle.dumps(task.score))(problems[0], problems[0].answer).verdict is Verdict.CORRECT


def test_length_distribution_of_seed_zero_is_heavy_tailed() -> None:
    """Completion tokens: (width + 1) per term with the byte-level tokenizer, eos included."""
    problems = get_task("progression", {}).load_problems("run", 0)
    lengths = sorted(len(p.answer) + 1 for p in problems)  # type: ignore[arg-type]
    assert lengths == sorted(4 * int(p.metadata["terms"]) for p in problems)

    def q(p: float) -> int:
        return lengths[int(p * (len(lengths) - 1))]

    assert (lengths[0], q(0.1), q(0.5), q(0.9), q(0.99), lengths[-1]) == (16, 28, 84, 252, 676, 1024)
    assert q(0.99) / q(0.5) >= 6 and 64 <= q(0.5) <= 128
    assert round(statistics.fmean(lengths)) == 122
    assert sum(n >= 512 for n in lengths) == 42  # a tail, not one outlier


def test_length_knobs_and_bad_params() -> None:
    fixed = get_task("progression", {"median_terms": 5, "sigma": 0, "num_problems": 50, "steps": [1]})
    assert {p.metadata["terms"] for p in fixed.load_problems("r", 0)} == {"5"}
    wide = get_task("progression", {"width": 4, "max_terms": 2000, "sigma": 3, "num_problems": 200})
    assert max(int(p.metadata["terms"]) for p in wide.load_problems("r", 0)) <= 2000
    narrow = get_task("progression", {"width": 2, "steps": [1, 3], "num_problems": 100})
    drawn = narrow.load_problems("r", 0)
    assert all(int(p.metadata["first"]) <= 99 for p in drawn)
    assert {p.metadata["step"] for p in drawn} == {"1", "3"}
    assert all(p.answer.endswith(f"{int(p.metadata['first']) % int(p.metadata['step']):02d}") for p in drawn)  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="max_terms must be >= min_terms"):
        get_task("progression", {"min_terms": 9, "max_terms": 3})
    with pytest.raises(ConfigError, match="steps must be positive"):
        get_task("progression", {"steps": [0, 2]})
    with pytest.raises(ConfigError, match="do not fit in 1 digits"):
        get_task("progression", {"width": 1, "min_terms": 5, "steps": [3]})


def test_warm_start_smoke(tmp_path: Path) -> None:
    """A few packed supervised steps on short progressions: the loss falls, the report comes back."""
    from stream_rl.inference.model_maker import make_model
    from stream_rl.tools.warm_start import warm_start

    out = make_model(tmp_path / "m", "tiny", seed=0)
    params = {"num_problems": 64, "median_terms": 4, "sigma": 0.3, "min_terms": 2, "max_terms": 8}
    first = warm_start(out, "progression", params, steps=1, batch_tokens=256, eval_size=4, progress=False)
    report = warm_start(out, "progression", params, steps=6, batch_tokens=256, eval_size=4, progress=False)
    assert report.final_loss < first.final_loss
    assert report.label_smoothing == 0.02  # the task's default
    assert 0.0 <= report.sampled_accuracy <= 1.0 and 0.0 <= report.greedy_accuracy <= 1.0
