"""`stream-rl export model|rollouts`: a run's weights and rollouts in the formats other tools read.

    stream-rl export model --run R [--version V] --out DIR      # a Hugging Face model directory
    stream-rl export rollouts --run R --out F.parquet           # the scored rollout log

- **model**: the weights of version V (default: the last) rebuilt from the run's checkpoints and
  `training-batches` (`stream_rl/train/rebuild.py`) and checked against V's checksum in
  `weight-versions`, so they are exactly the weights the inference servers were sent for V. DIR
  gets `save_pretrained` safetensors and config, the tokenizer with its chat template and the
  generation config of `model.path`, and `stream-rl-export.json` (run, version, checksum).
  `AutoModelForCausalLM.from_pretrained(DIR)` loads it.
- **rollouts**: every record of the run's `scored` topic, one row each, typed Parquet (see
  `ROLLOUT_SCHEMA`); `datasets.load_dataset("parquet", data_files=F)` or `pyarrow.parquet` reads it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from stream_rl.config import RunConfig, load_config
from stream_rl.contracts import ScoredRollout, token_versions
from stream_rl.errors import ConfigError, StreamRLError
from stream_rl.kafka.reader import read_to_end
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.topics import SCORED, TopicNames
from stream_rl.kafka.transport import Transport


def run_config(runs_dir: str | Path, run: str) -> RunConfig:
    """A finished (or running) run's recorded config: the trainer's record, else the launcher's."""
    run_dir = Path(runs_dir) / run
    for path in (run_dir / "trainer" / "record" / "config.yaml", run_dir / "config.yaml"):
        if path.is_file():
            config = load_config(path, [f"runs_dir={json.dumps(str(runs_dir))}"])
            return config if config.run == run else config.model_copy(update={"run": run})
    raise ConfigError(f"no recorded config for run {run} in {run_dir} (pass --runs-dir, or --config)")


def export_model(
    config: RunConfig, transport: Transport, out: Path, version: int | None = None
) -> dict[str, Any]:
    """Write version `version` (None: the last) of the run as a HF model directory; returns its record."""
    from transformers import AutoTokenizer

    from stream_rl.train.lineage import by_version, read_weight_versions
    from stream_rl.train.lora import LoraTrainer
    from stream_rl.train.rebuild import rebuild_version

    names = TopicNames(run=config.run, prefix=config.kafka.prefix)
    versions = by_version(read_weight_versions(transport, names))
    if not versions:
        raise StreamRLError(f"run {config.run} has no weight-versions: nothing was trained")
    version = max(versions) if version is None else version
    # The rebuild runs the torch backend on the CPU, as `replay trainer` does.
    cpu = config.model_copy(
        update={"trainer": config.trainer.model_copy(update={"backend": "torch", "device": "cpu"})}
    )
    trainer = rebuild_version(cpu, transport, version)
    if out.exists() and any(out.iterdir()):
        raise StreamRLError(f"{out} exists and is not empty: choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        if isinstance(trainer, LoraTrainer):  # its checkpoint's model/ is the adapter: merge instead
            trainer.save_merged(Path(tmp) / "model", config.model.path, config.model.dtype)
        else:
            trainer.save_to(Path(tmp))  # model/ (safetensors, config, generation config) + optimizer files
        for item in (Path(tmp) / "model").iterdir():
            shutil.move(str(item), out / item.name)
    AutoTokenizer.from_pretrained(config.model.path, local_files_only=True).save_pretrained(str(out))
    wv = versions[version]
    record = {
        "run": config.run,
        "version": version,
        "step": wv.step,
        "kind": wv.kind.value,
        "checksum": wv.checksum,
        "samples_trained": wv.samples_trained,
        "base_model": str(Path(config.model.path).resolve()),
    }
    (out / "stream-rl-export.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def _rollout_schema() -> Any:
    import pyarrow as pa

    span = pa.struct([("version", pa.int64()), ("start", pa.int32())])
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    return pa.schema(
        [
            ("rollout_id", pa.string()),
            ("group_id", pa.string()),
            ("problem_id", pa.string()),
            ("epoch", pa.int32()),
            ("sample_index", pa.int32()),
            ("task", pa.string()),
            ("prompt", pa.list_(message)),
            ("answer", pa.string()),
            ("completion", pa.string()),
            ("prompt_token_ids", pa.list_(pa.int32())),
            ("completion_token_ids", pa.list_(pa.int32())),
            ("completion_mask", pa.list_(pa.bool_())),
            ("logprobs", pa.list_(pa.float64())),
            ("version_spans", pa.list_(span)),
            ("version", pa.int64()),
            ("max_version", pa.int64()),
            ("finish_reason", pa.string()),
            ("num_turns", pa.int32()),
            ("reward", pa.float64()),
            ("verdict", pa.string()),
            ("verdict_detail", pa.string()),
            ("actor_id", pa.string()),
            ("server_id", pa.string()),
            ("generation_ms", pa.float64()),
            ("scored_ms", pa.int64()),
            ("partition", pa.int32()),
            ("offset", pa.int64()),
        ]
    )


ROLLOUT_COLUMNS = [
    "rollout_id", "group_id", "problem_id", "epoch", "sample_index", "task", "prompt", "answer",
    "completion", "prompt_token_ids", "completion_token_ids", "completion_mask", "logprobs",
    "version_spans", "version", "max_version", "finish_reason", "num_turns", "reward", "verdict",
    "verdict_detail", "actor_id", "server_id", "generation_ms", "scored_ms", "partition", "offset",
]  # fmt: skip
"""The Parquet columns; `version` is the version that sampled the first token (the oldest), and
`max_version` the newest; `completion_mask` marks sampled tokens (environment tokens False)."""


def rollout_row(s: ScoredRollout, partition: int, offset: int) -> dict[str, Any]:
    r = s.rollout
    versions = (
        token_versions(r.version_spans, len(r.completion_token_ids))
        or [sp.version for sp in r.version_spans]
        or [0]
    )
    return {
        "rollout_id": r.rollout_id,
        "group_id": r.group_id,
        "problem_id": r.problem.problem_id,
        "epoch": r.problem.epoch,
        "sample_index": r.sample_index,
        "task": r.problem.task,
        "prompt": [m.to_dict() for m in r.problem.prompt],
        "answer": r.problem.answer,
        "completion": r.text,
        "prompt_token_ids": r.prompt_token_ids,
        "completion_token_ids": r.completion_token_ids,
        "completion_mask": r.sampled_mask(),
        "logprobs": r.logprobs,
        "version_spans": [sp.to_dict() for sp in r.version_spans],
        "version": min(versions),
        "max_version": max(versions),
        "finish_reason": r.finish_reason,
        "num_turns": r.num_turns,
        "reward": s.reward,
        "verdict": s.verdict.value,
        "verdict_detail": s.detail,
        "actor_id": r.actor_id,
        "server_id": r.server_id,
        "generation_ms": r.generation_ms,
        "scored_ms": s.scored_ms,
        "partition": partition,
        "offset": offset,
    }


def export_rollouts(config: RunConfig, transport: Transport, out: Path, chunk: int = 5000) -> int:
    """Write every record of the run's `scored` to Parquet at `out`; returns the row count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    serde = default_serde()
    topic = TopicNames(run=config.run, prefix=config.kafka.prefix)[SCORED]
    schema = _rollout_schema()
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    count = 0
    with pq.ParquetWriter(str(out), schema) as writer:
        for msg in read_to_end(transport, topic, client_id="export-rollouts"):
            rows.append(rollout_row(serde.decode(msg.value, ScoredRollout), msg.partition, msg.offset))
            if len(rows) >= chunk:
                writer.write_table(pa.Table.from_pylist(rows, schema=schema))
                count += len(rows)
                rows = []
        if rows or not count:
            writer.write_table(pa.Table.from_pylist(rows, schema=schema))
            count += len(rows)
    return count


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from stream_rl.cli import add_common

    sub = parser.add_subparsers(dest="what", required=True, metavar="WHAT")
    for what, help_text in (
        ("model", "a version's weights as a Hugging Face model directory (checksum checked)"),
        ("rollouts", "the scored rollouts as Parquet"),
    ):
        p = sub.add_parser(what, help=help_text, description=help_text)
        p.add_argument("--run", required=True, help="run name")
        p.add_argument("--runs-dir", default="runs", help="where runs live (default runs/)")
        p.add_argument("--out", required=True, help="output directory (model) or .parquet file (rollouts)")
        if what == "model":
            p.add_argument("--version", type=int, default=None, help="weight version (default: the last)")
        add_common(p, config=False)


def main(args: argparse.Namespace) -> int:
    from stream_rl.kafka.confluent import KafkaTransport

    config = run_config(args.runs_dir, args.run)
    transport = KafkaTransport.for_run(config.kafka, args.bootstrap)
    out = Path(args.out)
    if args.what == "model":
        record = export_model(config, transport, out, args.version)
        print(
            f"exported version {record['version']} of run {record['run']} (checksum {record['checksum'][:16]}, "
            f"matches weight-versions) to {out}"
        )
    else:
        count = export_rollouts(config, transport, out)
        print(f"exported {count} scored rollouts of run {config.run} to {out}")
    return 0
