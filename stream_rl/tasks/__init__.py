"""Tasks: problem sources, scoring (plain registered functions) and multi-turn rollouts.

Importing this package registers the built-in tasks: `arithmetic` (the CPU demo's toy),
`math` (`\\boxed{}` answers checked with math-verify), `guessing` (multi-turn) and
`progression` (long, heavy-tailed completions checked exactly: the long-sequence benchmark's). Build one
with `get_task(config.task.name, config.task.params, config.task.system_prompt)`.
The modules are light: math-verify (sympy) is imported on the first math answer check.
"""

from stream_rl.tasks import arithmetic, guessing, math_task, progression
from stream_rl.tasks.base import (
    TASKS,
    Completion,
    ModelClient,
    MultiTurnResult,
    Scored,
    Task,
    TaskParams,
    get_task,
    register_task,
)

__all__ = [
    "TASKS",
    "Completion",
    "ModelClient",
    "MultiTurnResult",
    "Scored",
    "Task",
    "TaskParams",
    "arithmetic",
    "get_task",
    "guessing",
    "math_task",
    "progression",
    "register_task",
]
