"""`stream-rl replay trainer --run R`: re-train a finished (or running) run and compare checksums.

Inputs:
- the run's resolved config, `runs/<run>/trainer/record/config.yaml` as the trainer recorded it
  on its first start (or `--config`);
- its `weight-versions` log: the checksum of every version, and each version's
  `consumed_offsets`, which cut the steps exactly where the run cut them;
- its `training-batches`, read from offset 0 with an explicit assignment (no consumer group,
  nothing committed);
- the initial weights at `model.path` (or `--model`), checked against version 0's checksum.
Micro-batches are trained partition by partition up to each version's offsets (the topic has
one partition, so this is the run's order); records the trainer sent to the DLQ are skipped
the same way. Output: one table row per version; exit 0 only if every checksum matches.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from stream_rl.config import RunConfig, load_config
from stream_rl.contracts import TrainingBatch
from stream_rl.errors import ConfigError, ContractError, StreamRLError
from stream_rl.kafka.serde import Serde, default_serde
from stream_rl.kafka.stage import StopFlag
from stream_rl.kafka.topics import TRAINING_BATCHES, TopicNames
from stream_rl.kafka.transport import Message, TopicPartition, Transport
from stream_rl.train.lineage import by_version, read_weight_versions
from stream_rl.train.record import record_dir, recorded_config_path, version_drift

log = logging.getLogger(__name__)


@dataclass
class ReplayRow:
    version: int
    step: int
    recorded: str
    replayed: str
    samples_recorded: int
    samples_replayed: int

    @property
    def ok(self) -> bool:
        return self.recorded == self.replayed and self.samples_recorded == self.samples_replayed


@dataclass
class ReplayReport:
    rows: list[ReplayRow] = field(default_factory=list)
    error: str = ""
    """Why the replay stopped before the last version, if it did."""
    drift: str | None = None
    """The run was trained with another torch or transformers (`version_drift`), if it was."""

    @property
    def ok(self) -> bool:
        return bool(self.rows) and not self.error and all(r.ok for r in self.rows)

    def table(self) -> str:
        lines = [f"{'version':>7}  {'step':>5}  {'samples':>8}  {'recorded':<16}  {'replayed':<16}  match"]
        for r in self.rows:
            samples = f"{r.samples_replayed}" + ("" if r.samples_replayed == r.samples_recorded else "!")
            lines.append(
                f"{r.version:>7}  {r.step:>5}  {samples:>8}  {r.recorded[:16]:<16}  "
                f"{r.replayed[:16]:<16}  {'yes' if r.ok else 'NO'}"
            )
        matched = sum(r.ok for r in self.rows)
        lines.append(f"{matched}/{len(self.rows)} versions match" + (f"; {self.error}" if self.error else ""))
        return "\n".join(lines)


class _Reader:
    """Messages of the assigned partitions, handed out per partition in offset order."""

    def __init__(
        self, transport: Transport, topic: str, poll_timeout_s: float, start: dict[int, int] | None = None
    ) -> None:
        self.parts = sorted(transport.watermarks(topic))
        self.topic = topic
        self.consumer = transport.consumer(None, "replay-trainer")
        self.consumer.assign({(topic, p): (start or {}).get(p, 0) for p in self.parts})
        self.pending: dict[TopicPartition, deque[Message]] = {(topic, p): deque() for p in self.parts}
        self.poll_timeout_s = poll_timeout_s

    def next(self, tp: TopicPartition) -> Message:
        empty_polls = 0
        while not self.pending[tp]:
            msgs = self.consumer.poll_batch(256, 0.5)
            for m in msgs:
                self.pending[m.tp].append(m)
            empty_polls = 0 if msgs else empty_polls + 1
            if empty_polls * 0.5 > self.poll_timeout_s:
                raise StreamRLError(f"{tp[0]}[{tp[1]}] ends before the offsets the lineage recorded")
        return self.pending[tp].popleft()

    def close(self) -> None:
        self.consumer.close()


def replay_trainer(
    config: RunConfig,
    transport: Transport,
    *,
    model_path: str | None = None,
    serde: Serde | None = None,
    stop: StopFlag | None = None,
    poll_timeout_s: float = 10.0,
) -> ReplayReport:
    """Re-train the run from its topics; see the module docstring."""
    # torch only here: `stream-rl replay` also serves `replay preprocessor`, which needs none.
    from stream_rl.train.backends import build_trainer
    from stream_rl.train.step_runner import StepRunner, unusable_reason

    serde = serde or default_serde()
    names = TopicNames(run=config.run, prefix=config.kafka.prefix)
    versions = by_version(read_weight_versions(transport, names, serde))
    report = ReplayReport()
    init = record_dir(config) / "init.json"
    if init.is_file():
        report.drift = version_drift(json.loads(init.read_text()))
    if 0 not in versions:
        report.error = (
            f"the run {config.run!r} has no version 0 in its weight-versions (nothing trained yet: "
            f"`stream-rl trainer --config {config.run_dir / 'config.yaml'}` trains it)"
        )
        return report
    trainer = build_trainer(config, model_path)
    v0 = versions[0]
    report.rows.append(ReplayRow(0, 0, v0.checksum, trainer.checksum(), v0.samples_consumed, 0))
    reader = _Reader(transport, names.topic(TRAINING_BATCHES), poll_timeout_s)
    from stream_rl.train.dedupe import TrainedIds

    # The run's trainer dropped duplicates with the same window, from offset 0: same decisions.
    runner = StepRunner(trainer, config.trainer.pack_row_tokens, TrainedIds(config.trainer.dedupe_window))
    position = {tp: 0 for tp in reader.pending}
    consumed = 0
    try:
        for version in range(1, max(versions) + 1):
            if stop:
                report.error = "stopped"
                break
            wv = versions.get(version)
            if wv is None:
                report.error = f"version {version} is missing from weight-versions: cannot cut its step"
                break
            target = {(o.topic, o.partition): o.offset for o in wv.consumed_offsets}
            for tp in sorted(target):
                if tp not in position:
                    raise StreamRLError(f"version {version} consumed {tp}, which the topic does not have")
                while position[tp] < target[tp]:
                    msg = reader.next(tp)
                    position[tp] = msg.offset + 1
                    try:
                        batch = serde.decode(msg.value, TrainingBatch)
                    except ContractError:
                        continue  # the trainer sent it to the DLQ
                    if unusable_reason(batch, trainer.vocab_size) is None:
                        runner.add(batch, version - 1)
            summary = runner.finish()
            consumed += summary.acc.consumed
            report.rows.append(
                ReplayRow(version, wv.step, wv.checksum, trainer.checksum(), wv.samples_consumed, consumed)
            )
    except StreamRLError as exc:
        report.error = str(exc)
    finally:
        reader.close()
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `replay trainer` (`stream_rl.tools.replay` adds it as a subcommand)."""
    from stream_rl.cli import add_common

    parser.add_argument("--run", required=True, help="run name")
    parser.add_argument("--runs-dir", default="runs", help="where runs live (default runs/)")
    parser.add_argument("--model", default=None, help="initial weights (default: the recorded model.path)")
    add_common(parser)


def main(args: argparse.Namespace) -> int:
    from stream_rl.kafka.confluent import KafkaTransport

    recorded = recorded_config_path(args.runs_dir, args.run)
    if not recorded.is_file():  # no trainer ran yet: the launcher's (or `replay preprocessor`'s) config
        recorded = Path(args.runs_dir) / args.run / "config.yaml"
    if args.config is None and not recorded.is_file():
        raise ConfigError(f"{recorded} not found: pass --config (the run's config) or --runs-dir")
    config = load_config(args.config or recorded, args.overrides)
    if config.run != args.run:
        config = config.model_copy(update={"run": args.run})
    transport = KafkaTransport.for_run(config.kafka, args.bootstrap)
    stop = StopFlag()
    stop.install_signal_handlers()
    report = replay_trainer(config, transport, model_path=args.model, stop=stop)
    if report.drift:
        print(f"warning: {report.drift}", file=sys.stderr)
    print(report.table())
    return 0 if report.ok else 1
