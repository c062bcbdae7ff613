"""The CPU demo with vLLM as the inference engine: `stream-rl run configs/demo-cpu.yaml` against a
real vLLM server (the session's, tests/vllm_fixture.py, serving the demo's warm-started model),
a real broker, every stage its own process, weights pushed through the `stream_rl_gloo` plugin
at every version: the reward of what was sampled rises from <= 0.4 (first 3 versions) to >= 0.7
(last 3), in STEPS steps of the demo's 100 and without its held-out evaluations
(tests/e2e/test_research.py tests the evaluator), as `docker compose` does
(tests/docker/test_compose.py): each demo step costs the suite ~3 s of CPU here. The whole demo
on vLLM, to its 0.8, is `bench/engines.py --demo`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from stream_rl.contracts import TrainingBatch
from stream_rl.kafka.confluent import KafkaTransport
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.topics import TRAINING_BATCHES, TopicNames
from stream_rl.train.lineage import read_weight_versions

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.vllm,
    pytest.mark.timeout(int(os.environ.get("STREAM_RL_VLLM_TIMEOUT", "1800"))),
]

REPO = Path(__file__).resolve().parents[2]
STEPS = 60
"""At 50 steps (measured, 2 cores under load): reward 0.25 -> 0.74 (last 3), 0.82 at version 50."""


def test_the_cpu_demo_learns_on_vllm(
    tmp_path: Path, vllm_server: Any, kafka_bootstrap: str, kafka: KafkaTransport
) -> None:
    from vllm_fixture import DEMO_BATCH, TOKEN

    run = f"vllmdemo{os.getpid()}"
    overrides = {
        "run": run,
        "runs_dir": str(tmp_path / "runs"),
        "model": {"path": str(vllm_server.model)},
        "kafka": {"bootstrap": kafka_bootstrap, "partitions": 2},
        "inference": {"servers": [{"url": vllm_server.url, "engine": "vllm"}]},
        "launcher": {"max_wall_s": 600},
        "trainer": {"max_steps": STEPS},
        "eval": {"every": 0},
    }
    demo = yaml.safe_load((REPO / "configs" / "demo-cpu.yaml").read_text())
    for key, value in overrides.items():
        if isinstance(value, dict):
            demo.setdefault(key, {}).update(value)
        else:
            demo[key] = value
    assert demo["inference"]["max_batch"] == DEMO_BATCH, "the session's vLLM server runs the demo's batch"
    config = tmp_path / "demo-vllm.yaml"
    config.write_text(yaml.safe_dump(demo))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "STREAM_RL_ADMIN_TOKEN": TOKEN}
    done = subprocess.run(
        [sys.executable, "-m", "stream_rl.cli", "run", str(config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / run / "summary.json").read_text())
    print(json.dumps({k: summary[k] for k in ("reward", "wall_s", "version_lag") if k in summary}))
    assert summary["versions"]["last"] == demo["trainer"]["max_steps"]
    assert summary["reward"]["first3_mean"] <= 0.4
    assert summary["reward"]["last3_mean"] >= 0.7
    # Every version was installed on the vLLM server, and every trained token says by which.
    names = TopicNames(run=run)
    versions = read_weight_versions(kafka, names)
    assert all(v.servers_updated == [vllm_server.url] for v in versions), [v.servers_failed for v in versions]
    known = {v.version for v in versions}
    consumer = kafka.consumer(None, "vllm-demo-reader")
    consumer.assign({(names[TRAINING_BATCHES], 0): 0})
    spans = 0
    try:
        while msgs := consumer.poll_batch(500, 2.0):
            for m in msgs:
                for sample in default_serde().decode(m.value, TrainingBatch).samples:
                    assert sample.version_spans and {s.version for s in sample.version_spans} <= known
                    spans += len(sample.version_spans)
    finally:
        consumer.close()
    assert spans >= demo["trainer"]["max_steps"] * demo["trainer"]["samples_per_step"]
    assert summary["version_lag"]["max"] <= demo["actor"]["max_lag"] + 1
