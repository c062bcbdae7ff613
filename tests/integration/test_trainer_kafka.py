"""The trainer stage on a real broker, as a real process: SIGKILL after step k and restart gives
the uninterrupted run's lineage (every version once, same consumed offsets, same checksums), and
`stream-rl replay trainer` reproduces every checksum of that run (CLI entry point, in-process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fakes.training import make_batches, make_tiny_model, produce_batches, stage_config

from stream_rl import cli
from stream_rl.config import load_config
from stream_rl.contracts import TrainingBatch, WeightVersion
from stream_rl.kafka.follower import VersionFollower
from stream_rl.kafka.topics import TRAINING_BATCHES, TopicNames, apply_topics
from stream_rl.stages import trainer as trainer_stage
from stream_rl.train.lineage import read_weight_versions

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
STEPS = 6
SAMPLES_PER_STEP = 4


def lineage(kafka, names: TopicNames) -> list[WeightVersion]:  # type: ignore[no-untyped-def]
    return read_weight_versions(kafka, names)


def step_ends(batches: list[TrainingBatch], samples_per_step: int) -> list[int]:
    """Index of the last micro-batch of each step, cut the way the trainer cuts steps."""
    ends, consumed = [], 0
    for i, b in enumerate(batches):
        consumed += b.num_samples + b.num_filtered
        if consumed >= samples_per_step:
            ends.append(i)
            consumed = 0
    return ends


def start_trainer(config_path: Path, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "stream_rl.cli", "trainer", "--config", str(config_path), *extra]
    with log.open("ab") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def test_sigkill_and_restart_equals_uninterrupted_run_and_replays(  # type: ignore[no-untyped-def]
    kafka, kafka_bootstrap: str, run_names: TopicNames, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_tiny_model(tmp_path / "model")
    batches = make_batches(2 * STEPS, SAMPLES_PER_STEP // 2, seed=21, filtered_every=5)
    # Reference: the same batches, uninterrupted, in this process, in another run namespace.
    ref_names = TopicNames(run=run_names.run + "ref")
    apply_topics(kafka, ref_names)
    produce_batches(kafka, ref_names, batches)
    ref_cfg = stage_config(tmp_path / "ref", model, run=ref_names.run, checkpoint_every=2)
    ref_cfg = ref_cfg.model_copy(
        update={"kafka": ref_cfg.kafka.model_copy(update={"bootstrap": kafka_bootstrap})}
    )
    trainer_stage.run(ref_cfg, kafka, idle_timeout_s=2)
    ref = lineage(kafka, ref_names)
    assert [w.version for w in ref] == list(range(len(ref))) and len(ref) >= STEPS

    cfg = stage_config(tmp_path, model, run=run_names.run, checkpoint_every=2)
    data = cfg.model_dump(mode="json")
    data["kafka"]["bootstrap"] = kafka_bootstrap
    config_path = tmp_path / "run.yaml"
    config_path.write_text(yaml.safe_dump(data))
    log = tmp_path / "trainer.log"

    # First life: the batches of 3 steps and the first one of step 4. Killed once version 3 is
    # out: its checkpoint is at step 2, and step 4 is partly consumed (maybe trained, never stepped).
    k = 3
    cut = step_ends(batches, SAMPLES_PER_STEP)[k - 1] + 1
    produce_batches(kafka, run_names, batches[: cut + 1])
    follower = VersionFollower(kafka, run_names).start()
    proc = start_trainer(config_path, log, "--idle-timeout", "120")
    try:
        assert follower.wait_for_version(k, timeout=180), log.read_text()[-3000:]
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        follower.stop()
    assert proc.returncode == -signal.SIGKILL
    assert [w.version for w in lineage(kafka, run_names)] == list(range(k + 1))

    # Second life (in this process: the kill is what matters, and it saves a start-up): the
    # rest of the batches; it resumes from step 2, re-trains 3 (verified), and goes on.
    produce_batches(kafka, run_names, batches[cut + 1 :])
    second = trainer_stage.run(load_config(config_path), kafka, idle_timeout_s=2)
    assert second.verified == 2 and second.mismatches == 0  # versions 2 (re-broadcast) and 3
    got = lineage(kafka, run_names)
    assert [w.version for w in got] == [w.version for w in ref]  # each version exactly once
    assert [w.consumed_offsets[0].offset if w.consumed_offsets else 0 for w in got] == [
        w.consumed_offsets[0].offset if w.consumed_offsets else 0 for w in ref
    ]
    assert [(w.samples_trained, w.samples_filtered) for w in got] == [
        (w.samples_trained, w.samples_filtered) for w in ref
    ]
    assert [w.checksum for w in got] == [w.checksum for w in ref]
    committed = kafka.group_offsets(run_names.group("trainer"), run_names.topic(TRAINING_BATCHES))
    assert committed == {0: got[-1].consumed_offsets[0].offset}

    # Replay of the killed-and-restarted run through the CLI entry point, from the recorded config.
    argv = ["replay", "trainer", "--run", run_names.run, "--runs-dir", str(tmp_path / "runs")]
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = cli.main([*argv, "--bootstrap", kafka_bootstrap])
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"{len(got)}/{len(got)} versions match" in out
