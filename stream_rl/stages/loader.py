"""The loader: writes the task's problems to `problems`, once per (problem, epoch).

Consumes: the task's problem source (`Task.load_problems(run, seed)`, the first
`loader.max_problems` of them). Produces: `problems`, key = problem_id, one record per problem
and epoch (`Problem.epoch` = 0..epochs-1).

Invariants:
- Stable ids: problem ids come from the task (content or position in the source), never drawn
  per call; the group of a problem's epoch is `<problem_id>.e<epoch>` downstream.
- Order: each epoch is the problem list shuffled with `loader.seed` and the epoch number, so
  the same seed writes the same sequence. Record i of that plan goes to partition i mod P with a
  `seq` header i, so the actor can take problems in plan order across partitions, epoch after
  epoch (`stream_rl.stages.problem_order`).
- Idempotent: before writing, the loader reads `problems` to its end and writes only the
  (problem_id, epoch) pairs that are missing. Re-running it (after a crash, or with more epochs)
  never duplicates a problem of the same epoch. One loader per run: two at once could both
  find a pair missing.
- Durable: records are flushed (acknowledged by the broker) before the loader reports success.

Run alone: `stream-rl loader --config run.yaml` (`--max-records N` writes at most N problems).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import random

from stream_rl.config import RunConfig
from stream_rl.contracts import Problem
from stream_rl.errors import ContractError
from stream_rl.kafka.reader import read_to_end
from stream_rl.kafka.serde import Serde, default_serde
from stream_rl.kafka.stage import StageStats, StopFlag
from stream_rl.kafka.topics import PROBLEMS, TopicNames
from stream_rl.kafka.transport import Transport
from stream_rl.stages.entry import Instance, add_stage_arguments, open_transport, run_stage_command
from stream_rl.stages.problem_order import SEQ_HEADER
from stream_rl.tasks import get_task

log = logging.getLogger(__name__)

CONSUMES: str | None = None
"""The loader reads no topic: its source is the task."""
PRODUCES = (PROBLEMS,)


def plan(problems: list[Problem], epochs: int, seed: int) -> list[Problem]:
    """Every problem once per epoch; each epoch in its own seeded order."""
    out: list[Problem] = []
    for epoch in range(epochs):
        order = list(problems)
        random.Random(f"loader:{seed}:{epoch}").shuffle(order)
        out.extend(dataclasses.replace(p, epoch=epoch) for p in order)
    return out


def existing_pairs(transport: Transport, topic: str, serde: Serde) -> set[tuple[str, int]]:
    """(problem_id, epoch) of every problem already in the topic (undecodable records skipped)."""
    have: set[tuple[str, int]] = set()
    for msg in read_to_end(transport, topic, client_id="loader-check"):
        try:
            p = serde.decode(msg.value, Problem)
        except ContractError as exc:
            log.warning("loader: skipping undecodable %s[%d]@%d: %s", topic, msg.partition, msg.offset, exc)
            continue
        have.add((p.problem_id, p.epoch))
    return have


def run(
    config: RunConfig,
    *,
    transport: Transport | None = None,
    stop: StopFlag | None = None,
    max_records: int | None = None,
    idle_timeout_s: float | None = None,
    instance: Instance = 0,
) -> StageStats:
    """Write the missing (problem, epoch) records; `max_records` caps the records written.
    `idle_timeout_s` is accepted for symmetry with the other stages (the loader never waits)."""
    transport = open_transport(config, transport)
    stop = stop if stop is not None else StopFlag()
    serde = default_serde()
    topic = TopicNames(config.run, config.kafka.prefix)[PROBLEMS]
    task = get_task(config.task.name, config.task.params, config.task.system_prompt)
    problems = task.load_problems(config.run, config.seed)
    if config.loader.max_problems is not None:
        problems = problems[: config.loader.max_problems]
    have = existing_pairs(transport, topic, serde)
    partitions = sorted(transport.watermarks(topic))
    stats = StageStats()
    producer = transport.producer(f"loader-{instance}")
    try:
        for seq, problem in enumerate(plan(problems, config.loader.epochs, config.loader.seed)):
            if stop:
                stats.stopped_by = stop.reason or "stopped"
                break
            if (problem.problem_id, problem.epoch) in have:
                continue
            if max_records is not None and stats.records_out >= max_records:
                stats.stopped_by = "max_records"
                break
            producer.produce(
                topic,
                serde.encode(problem),
                key=problem.problem_id,
                headers={SEQ_HEADER: str(seq)},
                partition=partitions[seq % len(partitions)],
            )
            stats.records_out += 1
        producer.flush()
    finally:
        producer.close()
    stats.extra["already_present"] = float(len(have))
    log.info(
        "loader: wrote %d problem records to %s (%d were there already; %d problems x %d epochs)",
        stats.records_out,
        topic,
        len(have),
        len(problems),
        config.loader.epochs,
    )
    return stats


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_stage_arguments(parser)


def main(args: argparse.Namespace) -> int:
    return run_stage_command("loader", run, args)
