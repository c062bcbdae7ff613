"""The supervised warm start: it learns the task's format and reports where RL starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from stream_rl.errors import TaskError
from stream_rl.inference.model_maker import make_model
from stream_rl.tools.warm_start import warm_start

pytestmark = pytest.mark.unit


def test_warm_start_lowers_the_loss_and_reports_accuracy(tmp_path: Path) -> None:
    out = make_model(tmp_path / "m", "tiny", seed=0)
    params = {"max_operand": 9, "num_problems": 40}
    first = warm_start(out, "arithmetic", params, steps=2, eval_size=16, progress=False)
    # 16 examples a step (the task's 64 cost 4x the CPU for 6/16 instead of 5/16 below).
    report = warm_start(
        out, "arithmetic", params, steps=60, batch_size=16, lr=3e-3, eval_size=16, progress=False
    )
    assert report.final_loss < first.final_loss
    # Accuracies are shares of the 16 problems evaluated; training moved greedy decoding off zero
    # (seeded: 0 after 2 steps, 5/16 after 60 here, on 1 thread and on 2).
    for acc in (
        first.sampled_accuracy,
        first.greedy_accuracy,
        report.sampled_accuracy,
        report.greedy_accuracy,
    ):
        assert (acc * 16).is_integer(), acc
    assert report.greedy_accuracy > first.greedy_accuracy
    assert (out / "model.safetensors").exists()


def test_a_task_without_format_examples_cannot_be_warm_started(tmp_path: Path) -> None:
    out = make_model(tmp_path / "m", "tiny", seed=0)
    with pytest.raises(TaskError, match="format_example"):
        warm_start(out, "guessing", {}, steps=1, progress=False)
