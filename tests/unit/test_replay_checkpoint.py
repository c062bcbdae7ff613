"""`replay trainer` on the in-memory transport, and the checkpoint files themselves."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from fakes.training import make_batches, make_tiny_model, setup_topics
from fakes.training import stage_config as make_config

from stream_rl.contracts import TrainingBatch
from stream_rl.kafka.memory import MemoryTransport
from stream_rl.stages import trainer as trainer_stage
from stream_rl.train.backends import build_trainer
from stream_rl.train.checkpoint import (
    CheckpointError,
    TrainerState,
    latest_checkpoint,
    read_state,
    restore_rng,
    save_checkpoint,
)
from stream_rl.train.replay_trainer import replay_trainer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def test_replay_reproduces_every_checksum(tmp_path: Path, model_dir: Path) -> None:
    transport = MemoryTransport()
    batches: list[TrainingBatch | bytes] = list(make_batches(7, 2, seed=11, filtered_every=3))
    batches.insert(3, b"garbage")  # DLQ'd by the trainer, skipped by the replay
    setup_topics(transport, "r1", batches)
    cfg = make_config(tmp_path, model_dir, samples_per_step=5)
    stats = trainer_stage.run(cfg, transport, idle_timeout_s=0.5)
    assert stats.version >= 2
    report = replay_trainer(cfg, transport)
    assert report.ok, report.table()
    assert [r.version for r in report.rows] == list(range(stats.version + 1))
    assert "versions match" in report.table()

    # Another learning rate cannot reproduce the run: every trained version differs.
    other = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"lr": 2e-3})})
    bad = replay_trainer(other, transport)
    assert not bad.ok
    assert bad.rows[0].ok and not any(r.ok for r in bad.rows[1:])
    assert "NO" in bad.table()


def test_replay_warns_when_the_run_was_trained_with_other_kernels(tmp_path: Path, model_dir: Path) -> None:
    import json

    import transformers

    from stream_rl.train.record import record_dir

    transport = MemoryTransport()
    setup_topics(transport, "r1", list(make_batches(3, 2, seed=5)))
    cfg = make_config(tmp_path, model_dir, samples_per_step=4)
    trainer_stage.run(cfg, transport, idle_timeout_s=0.5)
    init = record_dir(cfg) / "init.json"
    recorded = json.loads(init.read_text())
    assert recorded["torch"] == torch.__version__ and recorded["transformers"] == transformers.__version__
    assert (record_dir(cfg) / "config.yaml").read_text().startswith("# written by: ")
    assert replay_trainer(cfg, transport).drift is None  # the same kernels: no warning
    init.write_text(json.dumps({**recorded, "torch": "2.12.0"}))
    drift = replay_trainer(cfg, transport).drift
    assert drift == (
        f"the run was trained with torch 2.12.0 (now {torch.__version__}): checksums may differ "
        "for that alone (bit-exact replay needs the recorded versions)"
    )


def test_replay_without_lineage_fails(tmp_path: Path, model_dir: Path) -> None:
    transport = MemoryTransport()
    setup_topics(transport, "r1", [])
    report = replay_trainer(make_config(tmp_path, model_dir), transport)
    assert not report.ok and "no version 0" in report.error


def test_checkpoint_round_trip_and_pruning(tmp_path: Path, model_dir: Path) -> None:
    cfg = make_config(tmp_path, model_dir)
    trainer = build_trainer(cfg)
    trainer.micro_batch(make_batches(1, 3, seed=12)[0].samples)
    trainer.optimizer_step(3)
    root = tmp_path / "ckpt"
    (root / ".tmp-step-000009-1").mkdir(parents=True)  # debris of a crash mid-save
    for step in (1, 2, 3):
        state = TrainerState(version=step, step=step, samples_trained=3 * step, offsets={("t", 0): 7 * step})
        state.checksum = trainer.checksum()
        torch.manual_seed(100 + step)
        save_checkpoint(root, trainer.save_to, state, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000002", "step-000003"]
    latest = latest_checkpoint(root)
    assert latest is not None and latest.name == "step-000003"
    state = read_state(latest)
    assert state.offsets == {("t", 0): 21} and state.samples_trained == 9
    assert (latest / "model" / "model.safetensors").is_file()

    expected = torch.rand(3)  # the RNG right after the save
    restored = build_trainer(cfg, latest / "model")
    random.seed(0)
    restored.load_from(latest)
    restore_rng(latest)
    assert torch.equal(torch.rand(3), expected)
    assert restored.checksum() == state.checksum
    assert restored.scheduler.last_epoch == 1
    assert (
        restored.optimizer.state_dict()["state"][0]["step"]
        == trainer.optimizer.state_dict()["state"][0]["step"]
    )


def test_latest_pointing_at_a_missing_checkpoint_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "latest").write_text("step-000004\n")
    with pytest.raises(CheckpointError, match="missing"):
        latest_checkpoint(tmp_path)
    assert latest_checkpoint(tmp_path / "nothing") is None
