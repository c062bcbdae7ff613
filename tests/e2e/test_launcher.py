"""`stream-rl run` end to end: a short run through the launcher on a real broker with a tiny CPU
model (every stage its own process), a stage killed mid-run without `launcher.restart`, and
replay. With `launcher.restart: true`, every stage killed in turn and restarted, no sample trained
twice: tests/e2e/test_chaos.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from stream_rl.contracts import TrainingBatch
from stream_rl.kafka.confluent import KafkaTransport
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.topics import TRAINING_BATCHES, TopicNames
from stream_rl.train.lineage import read_weight_versions

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from stream_rl.inference.model_maker import make_model

    return make_model(tmp_path_factory.mktemp("model") / "tiny", "tiny", seed=0)


def write_config(tmp_path: Path, model: Path, bootstrap: str, run: str, **extra: object) -> Path:
    cfg: dict[str, object] = {
        "run": run,
        "runs_dir": str(tmp_path / "runs"),
        "model": {"path": str(model)},
        "kafka": {"bootstrap": bootstrap, "partitions": 2},
        "task": {"name": "arithmetic", "params": {"num_problems": 200}},
        "actor": {"group_size": 4, "max_lag": 1, "sampling": {"max_tokens": 4}},
        "inference": {"num_servers": 1, "base_port": _free_port(), "max_batch": 32},
        "trainer": {"samples_per_step": 16, "max_steps": 4, "bucket_mb": 1, "checkpoint_every": 2},
        "launcher": {"max_wall_s": 240},
    }
    for key, value in extra.items():
        section, _, field = key.partition("__")
        cfg.setdefault(section, {})[field] = value  # type: ignore[index]
    path = tmp_path / f"{run}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _free_port() -> int:
    from stream_rl.common.ports import free_port

    return free_port()


def launch(config: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "stream_rl.cli", "run", str(config), *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def wait_for_version(
    kafka: KafkaTransport, run: str, version: int, proc: subprocess.Popen[str], timeout: float = 180
) -> None:
    names = TopicNames(run=run)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            versions = read_weight_versions(kafka, names)
        except Exception:  # noqa: BLE001 - topics may not exist yet
            versions = []
        if any(v.version >= version for v in versions):
            return
        time.sleep(1)
    raise AssertionError(f"version {version} not reached in {timeout}s")


def trained_samples(kafka: KafkaTransport, run: str) -> list[TrainingBatch]:
    """The micro-batches the trainer consumed (up to the final version's offsets)."""
    names = TopicNames(run=run)
    final = max(read_weight_versions(kafka, names), key=lambda v: v.version)
    end = {(o.topic, o.partition): o.offset for o in final.consumed_offsets}
    consumer = kafka.consumer(None, "e2e-reader")
    topic = names[TRAINING_BATCHES]
    consumer.assign({(topic, 0): 0})
    out: list[TrainingBatch] = []
    try:
        while True:
            msgs = consumer.poll_batch(500, 2.0)
            if not msgs:
                break
            out.extend(
                default_serde().decode(m.value, TrainingBatch)
                for m in msgs
                if m.offset < end.get((topic, 0), 0)
            )
    finally:
        consumer.close()
    return out


def test_short_run_through_the_launcher(
    tmp_path: Path, model_dir: Path, kafka_bootstrap: str, kafka: KafkaTransport
) -> None:
    run = f"e2e{os.getpid()}a"
    config = write_config(tmp_path, model_dir, kafka_bootstrap, run)
    proc = launch(config)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    run_dir = tmp_path / "runs" / run
    # The stages and the built-in server were forked from the fork server (a CPU run's default):
    # the replay below (a program) checks that what they trained is what a program trains.
    assert f"launcher.fork_stages: auto; its log: {run_dir / 'forkserver.log'}" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_reason"] == "reached max_steps (4)"
    assert summary["versions"]["last"] == 4
    assert summary["broker_lag"], "the launcher samples consumer lag"
    import torch
    import transformers

    # The versions this invocation ran: in the summary and heading the config copy (a comment).
    software = summary["software"]
    assert software["engine"] == "builtin" and software["torch"] == torch.__version__.split("+")[0]
    assert software["transformers"] == transformers.__version__
    header = (run_dir / "config.yaml").read_text().splitlines()[0]
    assert header.startswith("# written by: ") and f"torch {software['torch']}" in header
    assert any(
        json.loads(line)["kind"] == "lag" for line in (run_dir / "timeline.jsonl").read_text().splitlines()
    )
    for name in ("reward", "version_lag", "broker_lag", "throughput", "overview"):
        assert (run_dir / "plots" / f"{name}.png").stat().st_size > 5000
    # Every child wrote its resolved config and start command.
    for child in ("trainer", "loader", "actor-0", "verifier-0", "preprocessor-0", "server-0"):
        assert (run_dir / child / "cmd.txt").read_text().startswith(sys.executable), child
    # Versions 0..4 in order; every trained sample carries its version spans.
    versions = [v.version for v in read_weight_versions(kafka, TopicNames(run=run))]
    assert versions == [0, 1, 2, 3, 4]
    batches = trained_samples(kafka, run)
    samples = [s for b in batches for s in b.samples]
    assert len(samples) >= 4 * 16
    assert all(s.version_spans and s.version_spans[0].start == 0 for s in samples)
    # The lineage replays bit for bit.
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "stream_rl.cli",
            "replay",
            "trainer",
            "--run",
            run,
            "--runs-dir",
            str(tmp_path / "runs"),
            "--bootstrap",
            kafka_bootstrap,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def _kill_when_running(
    run_dir: Path, child: str, proc: subprocess.Popen[str], kafka: KafkaTransport, run: str
) -> int:
    wait_for_version(kafka, run, 1, proc)
    pid = json.loads((run_dir / "processes.json").read_text())["pids"][child]
    os.kill(pid, signal.SIGKILL)
    return int(pid)


def test_a_killed_stage_stops_the_run_and_is_named(
    tmp_path: Path, model_dir: Path, kafka_bootstrap: str, kafka: KafkaTransport
) -> None:
    run = f"e2e{os.getpid()}b"
    # Every child its own program (as on a GPU run): the path without the fork server.
    config = write_config(
        tmp_path, model_dir, kafka_bootstrap, run, trainer__max_steps=50, launcher__fork_stages="off"
    )
    proc = launch(config)
    try:
        _kill_when_running(tmp_path / "runs" / run, "verifier-0", proc, kafka, run)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out
    assert "verifier-0 died (killed by SIGKILL)" in out
    assert "fork_stages" not in out and not (tmp_path / "runs" / run / "forkserver.log").exists()
