"""A test task whose reward function misbehaves on cue (importing this module registers it).

`unruly` problems are arithmetic ones; the completion text decides what scoring does:
`raise` -> ValueError, `hang` -> sleeps for an hour, `crash` -> the process exits, `nan` -> a NaN
reward, anything else -> the arithmetic verdict.
"""

from __future__ import annotations

import os
import time

from stream_rl.contracts import Problem, Verdict
from stream_rl.tasks import Scored, register_task
from stream_rl.tasks.arithmetic import ArithmeticTask, score_arithmetic


@register_task("unruly")
class UnrulyTask(ArithmeticTask):
    def score(self, problem: Problem, completion: str, *, finish_reason: str = "stop") -> Scored:
        text = completion.strip()
        if text == "raise":
            raise ValueError("the reward function broke")
        if text == "hang":
            time.sleep(3600)
        if text == "crash":
            os._exit(3)
        if text == "nan":
            return Scored(Verdict.CORRECT, float("nan"))
        return score_arithmetic(problem.answer, completion, finish_reason)

    def reward(self, verdict: Verdict, finish_reason: str = "stop") -> float:
        return -1.0 if verdict in (Verdict.ERROR, Verdict.TIMEOUT) else super().reward(verdict, finish_reason)
