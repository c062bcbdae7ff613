"""`stream-rl replay preprocessor --run R --into R2 [--set key=value ...]`: an offline ablation.

Re-derives training batches from run R's `scored` topic, with other preprocessor settings, into a
new run namespace R2, so that the same rollouts can be trained another way (e.g. the group-mean
baseline, advantages divided by std, zero-advantage groups filtered):

1. R2's config: R's recorded config (`runs/R/config.yaml`, else `runs/R/trainer/record/config.yaml`,
   or `--config`) renamed R2, with no inference servers and no explicit checkpoint directory (a
   trainer started on R2 trains offline, from the same initial weights, into `runs/R2/`), then
   the `--set` overrides. Written to `runs/R2/config.yaml` before anything is consumed.
2. R2's topics are created; R2's `preprocessor-state` gets as many partitions as R's `scored`.
3. The real preprocessor (`stages/preprocessor.py`: grouping, duplicates, advantages, filter,
   packing, one Kafka transaction per poll) consumes R's `scored` from the beginning in R2's
   consumer group (`<prefix>.R2.preprocessor`) and writes R2's `training-batches`, state and DLQ.
   Nothing is written to R: its topics and its consumer groups' offsets stay as they were.
4. No backpressure (no trainer follows R2). The replay stops once its position reaches, on every
   partition, the end offset R's `scored` had when the replay started; or after `--idle-timeout`
   seconds without input (then the exit status is 1: the end was not reached).
5. A summary is printed and written to `runs/R2/replay.json`.

Re-running a replay into the same R2 resumes where the last one committed: nothing is written
twice. Groups R's `scored` holds only part of (the run stopped while they were in flight) stay
open in R2's state and are reported as incomplete; every complete group is written exactly once.

Next: `stream-rl trainer --config runs/R2/config.yaml --idle-timeout 30` trains on R2, and
`stream-rl replay trainer --run R2` then reproduces that training's checksums.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

from stream_rl.config import PreprocessorConfig, RunConfig, dump_config, load_config
from stream_rl.errors import ConfigError, KafkaError
from stream_rl.kafka.stage import StopFlag
from stream_rl.kafka.topics import SCORED, TopicNames, publish_schemas
from stream_rl.kafka.transport import Transport
from stream_rl.stages.preprocessor import Preprocessor, stage_loop

log = logging.getLogger(__name__)

INSTANCE = "replay"
"""The replay's instance id: transactional id `<prefix>.R2.preprocessor.replay`, which also fences
a second replay started into the same R2 while one runs."""

# Applied before the user's --set overrides, which win.
OFFLINE = ["inference.servers=[]", "inference.num_servers=0", "trainer.checkpoint_dir=null"]


@dataclass
class PreprocessorReplaySummary:
    source: str
    into: str
    settings: dict[str, tuple[object, object]]
    """R2's preprocessor settings that differ from R's (name -> (R's, R2's))."""
    records: int = 0
    """Records of R's `scored` consumed."""
    groups: int = 0
    """Complete groups (written or filtered)."""
    samples: int = 0
    """Samples written to R2's training-batches."""
    batches: int = 0
    filtered_groups: int = 0
    filtered_samples: int = 0
    duplicates: int = 0
    dlq: int = 0
    """Records sent to R2's `scored.dlq` as bad input (undecodable, group size mismatch)."""
    timed_out_groups: int = 0
    """Groups dead-lettered after `preprocessor.group_timeout_s` (wall time of the replay)."""
    incomplete_groups: int = 0
    """Groups left open at the end (R's `scored` holds only some of their samples)."""
    mean_abs_advantage: float = 0.0
    """Mean |advantage| over the samples written (one advantage per sample)."""
    exhausted: bool = False
    """Whether the replay reached the end of R's `scored`."""
    stopped_by: str = ""
    ends: dict[str, int] = field(default_factory=dict)
    """End offset of each partition of R's `scored` at the start (partition -> offset)."""

    def text(self) -> str:
        changed = ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in self.settings.items()) or "none"
        end = "end reached" if self.exhausted else f"END NOT REACHED, stopped by {self.stopped_by}"
        return "\n".join(
            [
                f"replay preprocessor: run {self.source} -> {self.into} (changed: {changed})",
                f"  consumed  {self.records} scored records ({end})",
                f"  groups    {self.groups} complete, {self.filtered_groups} of them filtered "
                f"({self.filtered_samples} samples); {self.incomplete_groups} incomplete (left open), "
                f"{self.timed_out_groups} timed out",
                f"  samples   {self.samples} in {self.batches} batches, mean |advantage| "
                f"{self.mean_abs_advantage:.4f}",
                f"  dropped   {self.duplicates} duplicates, {self.dlq} to the DLQ",
            ]
        )


def replay_config(
    source_config: str | Path,
    source: str,
    into: str,
    overrides: list[str],
    runs_dir: str | Path | None = None,
) -> tuple[RunConfig, RunConfig]:
    """(R's config, R2's config) from R's recorded config file; see the module docstring."""
    if into == source:
        raise ConfigError(f"--into must name a new run, not the source run {source!r}")
    base = load_config(source_config)
    # JSON-quoted: a YAML scalar that stays a string whatever the name looks like.
    extra = [f"runs_dir={json.dumps(str(runs_dir))}"] if runs_dir is not None else []
    target = load_config(source_config, [*OFFLINE, *extra, f"run={json.dumps(into)}", *overrides])
    if target.run != into:
        raise ConfigError(f"--set run={target.run} contradicts --into {into}")
    if target.kafka.prefix != base.kafka.prefix:
        raise ConfigError("kafka.prefix cannot change in a replay: R2's topics live beside R's")
    return base.model_copy(update={"run": source}), target


def _changed(a: PreprocessorConfig, b: PreprocessorConfig) -> dict[str, tuple[object, object]]:
    da, db = a.model_dump(), b.model_dump()
    return {k: (da[k], db[k]) for k in da if da[k] != db[k]}


def replay_preprocessor(
    source: RunConfig,
    target: RunConfig,
    transport: Transport,
    *,
    stop: StopFlag | None = None,
    idle_timeout_s: float | None = 60.0,
) -> PreprocessorReplaySummary:
    """Run the preprocessor of `target` (R2) on `source`'s (R's) `scored` until its end."""
    stop = stop if stop is not None else StopFlag()
    src_scored = TopicNames(source.run, source.kafka.prefix)[SCORED]
    dst = TopicNames(target.run, target.kafka.prefix)
    marks = transport.watermarks(src_scored)
    if not marks:
        raise KafkaError(f"{src_scored} has no partitions: is {source.run!r} a run on this cluster?")
    kcfg = target.kafka
    transport.create_topics(  # state partition i = scored partition i
        dst.all_topics(len(marks), kcfg.min_insync_replicas), dst.replication_factors(kcfg.replication_factor)
    )
    publish_schemas(transport, dst)
    ends = {(src_scored, p): high for p, (low, high) in marks.items() if high > low}
    committed = transport.group_offsets(dst.group("preprocessor"), src_scored)
    log.info(
        "replaying %s into run %s: %d records up to offsets %s",
        src_scored,
        target.run,
        sum(high - low for low, high in marks.values()),
        {p: high for (_t, p), high in sorted(ends.items())},
    )
    summary = PreprocessorReplaySummary(
        source.run,
        target.run,
        _changed(source.preprocessor, target.preprocessor),
        ends={str(p): high for (_t, p), high in sorted(ends.items())},
    )
    pre = Preprocessor(target, transport, stop, INSTANCE, scored_topic=src_scored)

    def at_end() -> bool:
        position = loop.consumer.position()
        return all(max(position.get(tp, -1), committed.get(tp[1], -1)) >= end for tp, end in ends.items())

    def end_check() -> None:
        # `before_poll`: in place of the live run's backpressure, which would wait forever here.
        # Open groups are counted here: closing the consumer revokes the partitions and their state.
        summary.incomplete_groups = pre.open_groups()
        if at_end():
            summary.exhausted = True
            stop.set(f"end of {src_scored}")

    loop = stage_loop(pre, before_poll=end_check)
    stats = loop.run(idle_timeout_s=idle_timeout_s)
    c = pre.counts
    summary.records = stats.records_in
    summary.groups = c["emitted"] + c["filtered"]
    summary.samples = c["samples_out"]
    summary.batches = c["batches"]
    summary.filtered_groups = c["filtered"]
    summary.filtered_samples = c["filtered_samples"]
    summary.duplicates = c["duplicates"]
    summary.dlq = stats.dlq
    summary.timed_out_groups = c["timed_out"]
    summary.mean_abs_advantage = pre.abs_advantage_sum / c["samples_out"] if c["samples_out"] else 0.0
    summary.stopped_by = stats.stopped_by
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from stream_rl.cli import add_common

    parser.add_argument("--run", required=True, help="source run R (its `scored` topic is read)")
    parser.add_argument("--into", required=True, help="new run R2 that receives the training batches")
    parser.add_argument("--runs-dir", default="runs", help="where runs live (default runs/)")
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=60.0,
        help="give up after S seconds without input before the end is reached (default 60)",
    )
    add_common(parser)


def source_config_path(runs_dir: str | Path, run: str) -> Path:
    """R's recorded config: the launcher's `runs/R/config.yaml`, else the trainer's record."""
    run_dir = Path(runs_dir) / run
    for path in (run_dir / "config.yaml", run_dir / "trainer" / "record" / "config.yaml"):
        if path.is_file():
            return path
    raise ConfigError(
        f"{run_dir / 'config.yaml'} not found: pass --config (run {run}'s config) or --runs-dir"
    )


def main(args: argparse.Namespace) -> int:
    from stream_rl.kafka.confluent import KafkaTransport

    path = args.config or source_config_path(args.runs_dir, args.run)
    overrides = list(args.overrides)
    if args.bootstrap:
        overrides.append(f"kafka.bootstrap={args.bootstrap}")
    source, target = replay_config(path, args.run, args.into, overrides, runs_dir=args.runs_dir)
    written = target.run_dir / "config.yaml"
    if written.is_file() and written.read_text() != dump_config(target):
        raise ConfigError(
            f"{written} exists with other settings: a replay into {target.run} already ran with them "
            "(its batches stay); replay into a new run, or delete that run's topics and directory"
        )
    target.run_dir.mkdir(parents=True, exist_ok=True)
    written.write_text(dump_config(target))
    transport = KafkaTransport.for_run(target.kafka)
    stop = StopFlag()
    stop.install_signal_handlers()
    summary = replay_preprocessor(source, target, transport, stop=stop, idle_timeout_s=args.idle_timeout)
    (target.run_dir / "replay.json").write_text(json.dumps(asdict(summary), indent=1) + "\n")
    print(summary.text())
    print(
        f"config: {target.run_dir / 'config.yaml'}; train on it with "
        f"`stream-rl trainer --config {target.run_dir / 'config.yaml'} --idle-timeout 30`"
    )
    return 0 if summary.exhausted else 1
