"""Checking a `\\boxed{}` answer against a reference with math-verify, under a wall-clock deadline.

`check_boxed_answer(gold, completion)` follows PipelineRL's verifier:
- the answer is the content of the LAST `\\boxed{...}`, found by a brace-matching scanner (nested
  groups such as `\\frac{1}{2}` are kept whole; the escaped braces `\\{` `\\}` of set notation do
  not count as grouping);
- no `\\boxed{` at all -> `no_answer`;
- an unclosed box, an empty (blank) box, more than `max_chars` characters, or content that
  math-verify cannot parse into a mathematical object -> `unparsable`;
- otherwise `math_verify.verify(gold, answer, strict)` -> `correct` or `wrong`;
- a reference answer math-verify cannot parse -> `error` (a data problem, not the model's);
- over the deadline -> `timeout`.

Timeouts. math-verify's own timeouts use `signal.alarm` with whole seconds and raise ValueError
off the main thread; when they fire they are reported as "wrong"/"unparsable", not as a timeout.
So they are switched off here and ONE deadline (`setitimer`, fractional seconds) covers both
parses and the comparison, raising an exception math-verify does not swallow (it is not an
`Exception`). That deadline can only be armed in the main thread; elsewhere the check runs
without one, and the verifier stage's process pool (whose workers run tasks in their main thread)
is the backstop that kills a stuck check. A timer already armed by the caller is restored.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from stream_rl.contracts import Verdict

BOX = "\\boxed{"


@dataclass(frozen=True, slots=True)
class Boxed:
    content: str
    closed: bool


def last_boxed(text: str) -> Boxed | None:
    """The content of the last `\\boxed{...}` in `text`, or None when there is none."""
    start = text.rfind(BOX)
    if start < 0:
        return None
    i = begin = start + len(BOX)
    depth = 1
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # an escaped character, `\{` and `\}` included, is never a group brace
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return Boxed(text[begin:i], closed=True)
        i += 1
    return Boxed(text[begin:], closed=False)


class _Deadline(BaseException):
    """Raised by the SIGALRM handler; a BaseException so math-verify's `except Exception` lets it by."""


@contextmanager
def deadline(seconds: float) -> Iterator[bool]:
    """Interrupt the body with `_Deadline` after `seconds` (main thread only; yields whether armed)."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield False
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise _Deadline

    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    old_delay, old_interval = 0.0, 0.0
    started = time.monotonic()
    try:
        # Armed inside the try: an alarm that fires at once still restores the handler.
        old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
        yield True
    finally:
        # Nested so that the handler is restored even if the alarm lands during the disarm.
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            signal.signal(signal.SIGALRM, old_handler)
            if old_delay > 0:
                left = max(old_delay - (time.monotonic() - started), 1e-6)
                signal.setitimer(signal.ITIMER_REAL, left, old_interval)


class _QuietTimeoutWarning(logging.Filter):
    """math-verify warns once per process that its timeouts are off: here that is deliberate."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


def _math_verify() -> Any:
    # Imported on first use: math-verify pulls in sympy (~2.5 s), which light processes never need.
    import math_verify

    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _QuietTimeoutWarning) for f in logger.filters):
            logger.addFilter(_QuietTimeoutWarning())
    return math_verify


def _has_math_object(parsed: list[Any]) -> bool:
    from sympy import Basic, MatrixBase

    return any(isinstance(p, (Basic, MatrixBase)) for p in parsed)


def gold_as_latex(gold: str) -> str:
    """The reference answer in a box (math-verify's extraction anchors on it); `$...$` stripped."""
    gold = gold.strip()
    if BOX in gold:
        return gold
    return BOX + gold.strip("$").strip() + "}"


def check_boxed_answer(
    gold: str,
    completion: str,
    *,
    strict: bool = True,
    timeout_s: float = 1.0,
    max_chars: int = 1000,
) -> tuple[Verdict, str]:
    """The verdict on `completion`'s last boxed answer against `gold`, and a short detail."""
    boxed = last_boxed(completion)
    if boxed is None:
        return Verdict.NO_ANSWER, "no \\boxed{} answer"
    if not boxed.closed:
        return Verdict.UNPARSABLE, "unclosed \\boxed{"
    if not boxed.content.strip():
        return Verdict.UNPARSABLE, "empty \\boxed{}"
    if len(boxed.content) > max_chars:
        return Verdict.UNPARSABLE, f"boxed answer longer than {max_chars} characters"
    mv = _math_verify()
    try:
        with deadline(timeout_s):
            gold_parsed = mv.parse(gold_as_latex(gold), parsing_timeout=None)
            if not _has_math_object(gold_parsed):
                return Verdict.ERROR, f"reference answer not parsable: {gold[:80]!r}"
            answer_parsed = mv.parse(BOX + boxed.content + "}", parsing_timeout=None)
            if not _has_math_object(answer_parsed):
                return Verdict.UNPARSABLE, f"cannot parse {boxed.content[:80]!r}"
            same = mv.verify(gold_parsed, answer_parsed, strict=strict, timeout_seconds=None)
    except _Deadline:
        return Verdict.TIMEOUT, f"math-verify took longer than {timeout_s:g} s"
    if same:
        return Verdict.CORRECT, ""
    return Verdict.WRONG, f"expected {gold[:80]!r}, got {boxed.content[:80]!r}"
