"""Scoring completions with the task's reward function, in worker processes, with a deadline.

`ScoringPool(task, workers, timeout_s).score_many(jobs)` returns one `Scored` per job, in order;
nothing is ever lost:
- the function's result: its verdict and reward;
- the function raised: verdict `error` (detail: the exception), reward `task.reward(error)`;
- no answer within `timeout_s` of the job's start: the worker process is killed by its pid
  (SIGKILL) and replaced; verdict `timeout`, reward `task.reward(timeout)`;
- the worker died (crash, out of memory): verdict `error`, the worker is replaced.

Workers run the function in their main thread (the math task's deadline uses signals), one job
at a time; they are forked from a forkserver (never from the stage process, whose Kafka client
threads do not survive a fork) and ignore SIGINT (the stage stops them). With `workers=0` the
stage process scores inline: exceptions still become `error`, but only the task's own deadline
bounds the time.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import signal
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from stream_rl.contracts import Problem, Verdict
from stream_rl.errors import TaskError
from stream_rl.tasks.base import Scored, Task

log = logging.getLogger(__name__)

Job = tuple[Problem, str, str]
"""(problem, completion text, finish reason)."""


def _worker_main(conn: multiprocessing.connection.Connection, task: Task) -> None:
    # The verifier owns its workers' lives (`close`, or SIGKILL on a timeout; its death ends them
    # by EOF): a Ctrl-C or a SIGTERM to the whole process group must not kill them under a batch
    # the verifier is finishing before it stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        _serve(conn, task)
    except (EOFError, ConnectionError, BrokenPipeError):
        return  # the verifier is gone (killed): nothing to answer, nothing to report


def _serve(conn: multiprocessing.connection.Connection, task: Task) -> None:
    conn.send(("ready", None))  # the task is unpickled (its modules imported): deadlines may start
    while True:
        job = conn.recv()
        if job is None:
            return
        problem, text, finish_reason = job
        try:
            scored = task.score(problem, text, finish_reason=finish_reason)
        except Exception as exc:  # noqa: BLE001 - any failure of a reward function is a verdict
            conn.send(("error", f"{type(exc).__name__}: {exc}"[:500]))
        else:
            conn.send(("ok", scored))


def score_inline(task: Task, job: Job) -> Scored:
    """Score in this process: an exception becomes verdict `error`."""
    problem, text, finish_reason = job
    try:
        return task.score(problem, text, finish_reason=finish_reason)
    except Exception as exc:  # noqa: BLE001 - any failure of a reward function is a verdict
        detail = f"{type(exc).__name__}: {exc}"[:500]
        return Scored(Verdict.ERROR, task.reward(Verdict.ERROR, finish_reason), detail)


STARTUP_TIMEOUT_S = 120.0


@dataclass(eq=False)
class _Worker:
    process: Any
    conn: multiprocessing.connection.Connection
    ready: bool = False
    job: int | None = None
    deadline: float = 0.0


class ScoringPool:
    def __init__(self, task: Task, workers: int, timeout_s: float) -> None:
        self.task = task
        self.timeout_s = timeout_s
        self.restarts = 0
        """Workers replaced after a timeout or a crash (since start)."""
        self._ctx = multiprocessing.get_context("forkserver")
        # Workers fork from a server that has imported the tasks already (when it starts now).
        self._ctx.set_forkserver_preload(["stream_rl.tasks", type(task).__module__])
        self._workers = [self._start() for _ in range(workers)]

    def _start(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(target=_worker_main, args=(child, self.task), daemon=True)
        process.start()
        child.close()
        return _Worker(process, parent, deadline=time.monotonic() + STARTUP_TIMEOUT_S)

    def _await_ready(self, worker: _Worker) -> None:
        """A started worker must say it is ready: a job's deadline never pays for its imports."""
        left = max(worker.deadline - time.monotonic(), 0.0)
        try:
            if worker.conn.poll(left) and worker.conn.recv() == ("ready", None):
                worker.ready = True
                return
            what = f"did not start within {STARTUP_TIMEOUT_S:g}s"
        except (EOFError, OSError):
            worker.process.join(5)
            what = f"exited at start (exit code {worker.process.exitcode}; its stderr says why)"
        raise TaskError(
            f"a scoring process for task {self.task.name!r} {what}; the task must be importable in a "
            "fresh process, and a script that starts the verifier needs `if __name__ == '__main__':`"
        )

    def _replace(self, worker: _Worker) -> None:
        worker.process.kill()  # SIGKILL by pid: a hung reward function cannot ignore it
        worker.process.join(5)
        worker.conn.close()
        self._workers[self._workers.index(worker)] = self._start()
        self.restarts += 1

    def _verdict(self, verdict: Verdict, job: Job, detail: str) -> Scored:
        return Scored(verdict, self.task.reward(verdict, job[2]), detail)

    def score_many(self, jobs: list[Job]) -> list[Scored]:
        if not self._workers:
            return [score_inline(self.task, job) for job in jobs]
        results: list[Scored | None] = [None] * len(jobs)
        todo = deque(range(len(jobs)))
        while todo or any(w.job is not None for w in self._workers):
            for worker in list(self._workers):
                if not worker.ready and todo:
                    self._await_ready(worker)
                if worker.job is None and todo:
                    nxt = todo.popleft()
                    try:
                        worker.conn.send(jobs[nxt])
                    except (BrokenPipeError, OSError):  # died while idle: replace, retry the job
                        todo.appendleft(nxt)
                        self._replace(worker)
                        continue
                    worker.job, worker.deadline = nxt, time.monotonic() + self.timeout_s
            busy = [w for w in self._workers if w.job is not None]
            if not busy:  # every idle worker was found dead and replaced: send again (once ready)
                continue
            wait = max(min(w.deadline for w in busy) - time.monotonic(), 0.0)
            ready = set(multiprocessing.connection.wait([w.conn for w in busy], timeout=wait))
            now = time.monotonic()
            for worker in busy:
                assert worker.job is not None
                i = worker.job
                if worker.conn in ready:
                    try:
                        kind, payload = worker.conn.recv()
                    except (EOFError, OSError):
                        code = worker.process.exitcode
                        log.warning(
                            "scoring worker %d died (exit %s); replacing it", worker.process.pid, code
                        )
                        results[i] = self._verdict(
                            Verdict.ERROR, jobs[i], f"scoring process died (exit {code})"
                        )
                        self._replace(worker)
                        continue
                    worker.job = None
                    if kind == "ok":
                        results[i] = payload
                    else:
                        results[i] = self._verdict(Verdict.ERROR, jobs[i], payload)
                elif now >= worker.deadline:
                    log.warning(
                        "scoring worker %d exceeded %.1fs; killing and replacing it",
                        worker.process.pid,
                        self.timeout_s,
                    )
                    results[i] = self._verdict(
                        Verdict.TIMEOUT, jobs[i], f"scoring took longer than {self.timeout_s:g}s"
                    )
                    self._replace(worker)
        done = [r for r in results if r is not None]
        assert len(done) == len(jobs)
        return done

    def close(self) -> None:
        for worker in self._workers:
            with contextlib.suppress(BrokenPipeError, OSError):
                worker.conn.send(None)
        for worker in self._workers:
            worker.process.join(2)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(2)
            worker.conn.close()
        self._workers = []
