"""`configs/long-cpu.yaml` end to end: a few steps of the long-sequence run through the launcher
with a real broker (a random tiny model, so completions run long and are cut at max_tokens)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stream_rl.common.ports import free_port
from stream_rl.config import load_config
from stream_rl.kafka.confluent import KafkaTransport
from stream_rl.kafka.topics import TopicNames
from stream_rl.train.lineage import read_weight_versions

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "long-cpu.yaml"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from stream_rl.inference.model_maker import make_model

    return make_model(tmp_path_factory.mktemp("model") / "tiny", "tiny", seed=0)


def test_long_cpu_config_runs_through_the_launcher(
    tmp_path: Path, model_dir: Path, kafka_bootstrap: str, kafka: KafkaTransport
) -> None:
    run = f"e2e{os.getpid()}long"
    overrides = [
        f"run={run}",
        f"runs_dir={tmp_path / 'runs'}",
        f"model.path={model_dir}",
        f"kafka.bootstrap={kafka_bootstrap}",
        "kafka.partitions=2",
        f"inference.base_port={free_port()}",
        "trainer.sync_master_port=0",
        # two small steps: 2 groups of 8 per step; the random model never stops on its own
        "trainer.samples_per_step=16",
        "trainer.max_steps=2",
        "actor.sampling.max_tokens=160",
        "launcher.max_wall_s=240",
    ]
    config = load_config(CONFIG, overrides)
    assert config.task.name == "progression" and not config.actor.straggler_guard
    cmd = [sys.executable, "-m", "stream_rl.cli", "run", str(CONFIG)]
    for item in overrides:
        cmd += ["--set", item]
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / run / "summary.json").read_text())
    assert summary["exit_reason"] == "reached max_steps (2)"
    versions = read_weight_versions(kafka, TopicNames(run=run))
    assert [v.version for v in versions] == [0, 1, 2]
    for v in versions[1:]:
        assert v.metrics["samples"] >= 16
        # long completions: a random model rarely samples the end-of-sequence token, so most run
        # to max_tokens (160); prompts have 28 tokens
        assert v.metrics["tokens_trained"] >= 16 * (28 + 60)
        assert sum(n for k, n in v.metrics.items() if k.startswith("version_lag_n")) == v.metrics["samples"]
