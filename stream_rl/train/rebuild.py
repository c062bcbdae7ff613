"""The weights of any version of a run, rebuilt from its record and checked against its lineage.

`rebuild_version(config, transport, V)` starts from the newest checkpoint at or before V (weights,
optimizer, schedule, RNG, consumed offsets: `runs/<run>/trainer/checkpoints/`), or from version 0
(`model.path`), and re-trains the micro-batches of `training-batches` up to V, cutting every step at
the offsets its `WeightVersion` recorded, exactly as `replay trainer` does (bit-exact on CPU with
`trainer.deterministic`). The result's checksum must equal V's in `weight-versions`, else
`StreamRLError`: the weights handed out are those the servers were sent for V.
"""

from __future__ import annotations

import logging
from pathlib import Path

from stream_rl.config import RunConfig
from stream_rl.contracts import TrainingBatch
from stream_rl.errors import ContractError, StreamRLError
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.topics import TRAINING_BATCHES, TopicNames
from stream_rl.kafka.transport import Transport
from stream_rl.train.checkpoint import checkpoint_root, read_state, restore_rng
from stream_rl.train.lineage import by_version, read_weight_versions
from stream_rl.train.step import TrainerBackend

log = logging.getLogger(__name__)


def checkpoint_at_or_before(root: Path, version: int) -> Path | None:
    """The newest durable checkpoint of `root` whose version is at most `version`."""
    best: tuple[int, Path] | None = None
    for path in sorted(root.glob("step-*")):
        if not (path / "state.json").is_file():
            continue
        v = read_state(path).version
        if v <= version and (best is None or v > best[0]):
            best = (v, path)
    return None if best is None else best[1]


def rebuild_version(
    config: RunConfig, transport: Transport, version: int, *, model_path: str | None = None
) -> TrainerBackend:
    """A trainer backend holding exactly version `version` of the run (see the module docstring)."""
    from stream_rl.train.backends import build_trainer
    from stream_rl.train.replay_trainer import _Reader
    from stream_rl.train.step_runner import StepRunner, unusable_reason

    serde = default_serde()
    names = TopicNames(run=config.run, prefix=config.kafka.prefix)
    versions = by_version(read_weight_versions(transport, names, serde))
    if version not in versions:
        known = f"{min(versions)}..{max(versions)}" if versions else "none"
        raise StreamRLError(
            f"run {config.run} has no version {version} in weight-versions (versions: {known})"
        )
    ckpt = checkpoint_at_or_before(checkpoint_root(config), version)
    if ckpt is not None:
        state = read_state(ckpt)
        trainer = build_trainer(config, ckpt / "model")
        trainer.load_from(ckpt)
        restore_rng(ckpt)
        current, start = state.version, {p: o for (_t, p), o in state.offsets.items()}
        log.info("rebuilding version %d from checkpoint %s (version %d)", version, ckpt, current)
    else:
        if 0 not in versions:
            raise StreamRLError(f"run {config.run} has no version 0 to start from")
        trainer = build_trainer(config, model_path)
        current, start = 0, {}
    topic = names.topic(TRAINING_BATCHES)
    if current < version:
        reader = _Reader(transport, topic, 10.0, start)
        runner = StepRunner(trainer, config.trainer.pack_row_tokens)
        position = {(topic, p): start.get(p, 0) for p in reader.parts}
        try:
            for v in range(current + 1, version + 1):
                wv = versions.get(v)
                if wv is None:
                    raise StreamRLError(f"version {v} is missing from weight-versions: cannot cut its step")
                for o in wv.consumed_offsets:
                    tp = (o.topic, o.partition)
                    while position[tp] < o.offset:
                        msg = reader.next(tp)
                        position[tp] = msg.offset + 1
                        try:
                            batch = serde.decode(msg.value, TrainingBatch)
                        except ContractError:
                            continue  # the trainer sent it to the DLQ
                        if unusable_reason(batch, trainer.vocab_size) is None:
                            runner.add(batch, v - 1)
                runner.finish()
        finally:
            reader.close()
    checksum = trainer.checksum()
    if checksum != versions[version].checksum:
        raise StreamRLError(
            f"rebuilt version {version} of run {config.run} has checksum {checksum[:16]}, its weight-versions "
            f"record says {versions[version].checksum[:16]}: not the served weights (training not deterministic "
            f"here: threads, library versions, or trainer.backend?)"
        )
    return trainer
