"""`stream-rl rescore --run R --into R2 [--set task.params.rewards=base ...]`: re-score R's rollouts.

Reads every record of R's `scored` topic and scores its rollout again with the task's verifier as
the current code and config define it (`Task.score(problem, text, finish_reason=...)`; a fixed
verifier, another reward table), without generating anything. The results go to R2's `scored`
(R2's topics are created; same keys, so groups stay in one partition), R2's config is R's recorded
config renamed R2 with the `--set` overrides and no inference servers (`runs/R2/config.yaml`), and
a summary (records, verdicts that changed, mean reward before and after) is printed and written to
`runs/R2/rescore.json`. R is not written to. R2 must be new: a second rescore into the same R2 is
refused (its `scored` is not empty), so nothing is written twice.

Next: `stream-rl replay preprocessor --run R2 --into R3` or a preprocessor and trainer on
`runs/R2/config.yaml` train on the re-scored rollouts.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from stream_rl.config import RunConfig, dump_config
from stream_rl.contracts import ScoredRollout
from stream_rl.errors import ConfigError
from stream_rl.kafka.reader import read_to_end
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.topics import SCORED, TopicNames, apply_topics, publish_schemas
from stream_rl.tasks import get_task

if TYPE_CHECKING:
    from stream_rl.kafka.confluent import KafkaTransport

VERIFIER_ID = "rescore"


@dataclass
class RescoreSummary:
    source: str
    into: str
    records: int = 0
    changed: int = 0
    """Records whose verdict or reward changed."""
    transitions: dict[str, int] = field(default_factory=dict)
    """'old -> new' verdict counts of the changed records."""
    mean_reward_before: float = 0.0
    mean_reward_after: float = 0.0

    def text(self) -> str:
        moves = ", ".join(f"{k}: {v}" for k, v in sorted(self.transitions.items())) or "none"
        return (
            f"rescore: run {self.source} -> {self.into}: {self.records} rollouts re-scored, {self.changed} "
            f"changed ({moves}); mean reward {self.mean_reward_before:.4f} -> {self.mean_reward_after:.4f}"
        )


def rescore(source: RunConfig, target: RunConfig, transport: KafkaTransport) -> RescoreSummary:
    """Re-score `source`'s scored rollouts into `target`'s `scored` (see the module docstring)."""
    src = TopicNames(run=source.run, prefix=source.kafka.prefix)
    dst = TopicNames(run=target.run, prefix=target.kafka.prefix)
    if dst[SCORED] in set(transport.list_topic_names()):
        ends = transport.watermarks(dst[SCORED])
        if any(high > low for low, high in ends.values()):
            raise ConfigError(f"--into {target.run}: that run already has scored rollouts; choose a new name")
    partitions = len(transport.partitions(src[SCORED]))
    apply_topics(
        transport,
        dst,
        partitions,
        replication_factor=target.kafka.replication_factor,
        min_insync_replicas=target.kafka.min_insync_replicas,
    )
    publish_schemas(transport, dst)
    task = get_task(target.task.name, target.task.params, target.task.system_prompt)
    serde = default_serde()
    producer = transport.producer(f"rescore-{target.run}")
    summary = RescoreSummary(source=source.run, into=target.run)
    moves: Counter[str] = Counter()
    before = after = 0.0
    for msg in read_to_end(transport, src[SCORED], client_id="rescore"):
        old = serde.decode(msg.value, ScoredRollout)
        r = old.rollout
        scored = task.score(r.problem, r.text, finish_reason=r.finish_reason)
        new = ScoredRollout(
            rollout=r,
            reward=scored.reward,
            verdict=scored.verdict,
            verifier_id=VERIFIER_ID,
            detail=scored.detail,
        )
        # Same partition as in R: the preprocessor's groups never span partitions.
        producer.produce(dst[SCORED], serde.encode(new), key=msg.key, partition=msg.partition)
        summary.records += 1
        before += old.reward
        after += new.reward
        if (old.verdict, old.reward) != (new.verdict, new.reward):
            summary.changed += 1
            moves[f"{old.verdict.value} -> {new.verdict.value}"] += 1
    producer.flush()
    producer.close()
    summary.transitions = dict(moves)
    if summary.records:
        summary.mean_reward_before = before / summary.records
        summary.mean_reward_after = after / summary.records
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from stream_rl.cli import add_common

    parser.add_argument("--run", required=True, help="the run whose rollouts are re-scored")
    parser.add_argument("--into", required=True, help="the new run that gets them")
    parser.add_argument("--runs-dir", default="runs", help="where runs live (default runs/)")
    add_common(parser)


def main(args: argparse.Namespace) -> int:
    from stream_rl.kafka.confluent import KafkaTransport
    from stream_rl.stages.preprocessor_replay import replay_config
    from stream_rl.train.record import recorded_config_path

    recorded = Path(args.config) if args.config else recorded_config_path(args.runs_dir, args.run)
    if not recorded.is_file():
        recorded = Path(args.runs_dir) / args.run / "config.yaml"
    if not recorded.is_file():
        raise ConfigError(f"{recorded} not found: pass --config (the run's config) or --runs-dir")
    source, target = replay_config(recorded, args.run, args.into, args.overrides, args.runs_dir)
    transport = KafkaTransport.for_run(source.kafka, args.bootstrap)
    summary = rescore(source, target, transport)
    target.run_dir.mkdir(parents=True, exist_ok=True)
    (target.run_dir / "config.yaml").write_text(dump_config(target))
    (target.run_dir / "rescore.json").write_text(json.dumps(asdict(summary), indent=2) + "\n")
    print(summary.text())
    return 0
