"""The verifier: scores rollouts with the task's reward function.

Consumes `raw-rollouts` (consumer group `verifier`). Produces `scored` (key = group_id, so a
group stays in one partition): each rollout with its reward, verdict and detail. Records that do
not decode, or belong to another task, go to `raw-rollouts.dlq`.

Invariants:
- Every decodable rollout of the run's task yields exactly one scored record per delivery: a
  reward function that raises gives verdict `error`, one that runs past `verifier.timeout_s` gives
  `timeout` (its worker process is killed and replaced), both with `task.reward(verdict)`; a
  non-finite reward is an `error` too. Nothing is lost (see `stream_rl.stages.scoring`).
- At least once (`StageLoop`): offsets are committed after the scored records are flushed; a
  crash re-scores the uncommitted batch and the preprocessor drops the duplicates by rollout_id.
- Scoring uses `rollout.text` (without the end-of-sequence token; for multi-turn tasks the
  whole conversation, which carries the environment's result).

Run alone: `stream-rl verifier --config run.yaml [--instance i]`; several instances in the
group share the partitions.
"""

from __future__ import annotations

import argparse
import logging
import math
import time

from prometheus_client import Counter, Histogram

from stream_rl.config import RunConfig
from stream_rl.contracts import Rollout, ScoredRollout, Verdict
from stream_rl.kafka.stage import Incoming, Output, Reject, StageLoop, StageStats, StopFlag
from stream_rl.kafka.topics import RAW_ROLLOUTS, SCORED, TopicNames
from stream_rl.kafka.transport import Transport
from stream_rl.stages.entry import Instance, add_stage_arguments, open_transport, run_stage_command
from stream_rl.stages.scoring import ScoringPool
from stream_rl.tasks import Scored, get_task

log = logging.getLogger(__name__)

CONSUMES = RAW_ROLLOUTS
PRODUCES = (SCORED,)

VERDICTS = Counter("stream_rl_verifier_verdicts", "Scored rollouts by verdict", ["verdict"])
SCORE_SECONDS = Histogram(
    "stream_rl_verifier_batch_score_seconds",
    "Time to score one polled batch",
    buckets=(0.001, 0.01, 0.1, 0.5, 2, 10, 60),
)


class Verifier:
    def __init__(self, config: RunConfig, pool: ScoringPool, verifier_id: str) -> None:
        self.task = pool.task
        self.pool = pool
        self.verifier_id = verifier_id
        self.out_topic = TopicNames(config.run, config.kafka.prefix)[SCORED]

    def _finite(self, scored: Scored, finish_reason: str) -> Scored:
        if math.isfinite(scored.reward):
            return scored
        reward = self.task.reward(Verdict.ERROR, finish_reason)
        return Scored(Verdict.ERROR, reward, f"reward function returned {scored.reward!r} ({scored.verdict})")

    def handle(self, batch: list[Incoming[Rollout]]) -> list[Output | Reject]:
        out: list[Output | Reject] = []
        todo: list[Incoming[Rollout]] = []
        for item in batch:
            task = item.value.problem.task
            if task != self.task.name:
                out.append(Reject(item, f"rollout of task {task!r}; this run's task is {self.task.name!r}"))
            else:
                todo.append(item)
        started = time.perf_counter()
        scores = self.pool.score_many([(i.value.problem, i.value.text, i.value.finish_reason) for i in todo])
        SCORE_SECONDS.observe(time.perf_counter() - started)
        for item, raw in zip(todo, scores, strict=True):
            rollout = item.value
            scored = self._finite(raw, rollout.finish_reason)
            VERDICTS.labels(scored.verdict.value).inc()
            record = ScoredRollout(
                rollout=rollout,
                reward=scored.reward,
                verdict=scored.verdict,
                verifier_id=self.verifier_id,
                detail=scored.detail,
            )
            out.append(Output(self.out_topic, record, key=rollout.group_id))
        return out


def run(
    config: RunConfig,
    *,
    transport: Transport | None = None,
    stop: StopFlag | None = None,
    max_records: int | None = None,
    idle_timeout_s: float | None = None,
    instance: Instance = 0,
) -> StageStats:
    """Score until stopped, `max_records` rollouts consumed, or `idle_timeout_s` without input."""
    transport = open_transport(config, transport)
    names = TopicNames(config.run, config.kafka.prefix)
    task = get_task(config.task.name, config.task.params, config.task.system_prompt)
    verifier_id = f"verifier-{instance}"
    pool = ScoringPool(task, config.verifier.workers, config.verifier.timeout_s)
    try:
        verifier = Verifier(config, pool, verifier_id)
        loop: StageLoop[Rollout] = StageLoop(
            name="verifier",
            transport=transport,
            group=names.group("verifier"),
            input_topic=names[RAW_ROLLOUTS],
            input_type=Rollout,
            handle=verifier.handle,
            dlq_topic=names.dlq(RAW_ROLLOUTS),
            client_id=verifier_id,
            instance_id=f"{config.kafka.prefix}.{config.run}.verifier.{instance}",
            batch_size=config.verifier.batch_size,
            stop=stop,
            commit_every_s=config.verifier.commit_every_s,
        )
        stats = loop.run(max_records=max_records, idle_timeout_s=idle_timeout_s)
    finally:
        pool.close()
    stats.extra["worker_restarts"] = float(pool.restarts)
    return stats


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_stage_arguments(parser)


def main(args: argparse.Namespace) -> int:
    return run_stage_command("verifier", run, args)
