"""Each tracker sink with its real library, fed from a run's real topics: W&B offline (its
`.wandb` log read back), MLflow (a real tracking server, read back through its REST API),
TensorBoard (event files read back). `stream-rl track` backfills; values must equal the topics'."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fakes.records import make_eval_result, make_weight_version

from stream_rl.config import dump_config, load_config
from stream_rl.contracts import WeightVersionKind
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.topics import EVAL_RESULTS, WEIGHT_VERSIONS, TopicNames

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
VERSIONS = 5


@pytest.fixture(scope="module")
def tracked_run(
    tmp_path_factory: pytest.TempPathFactory, kafka_bootstrap: str
) -> tuple[str, Path, dict[str, dict[int, float]]]:
    """A run's topics with 5 versions and 3 evaluations, its run directory, and the expected metrics."""
    import uuid

    from stream_rl.kafka.confluent import KafkaTransport
    from stream_rl.kafka.topics import apply_topics

    kafka = KafkaTransport(kafka_bootstrap)
    run = f"trk{uuid.uuid4().hex[:10]}"
    names = TopicNames(run=run)
    apply_topics(kafka, names, partitions=1)
    runs_dir = tmp_path_factory.mktemp("runs")
    config = load_config(
        None, [f"run={run}", f"runs_dir={runs_dir}", f"kafka.bootstrap={kafka_bootstrap}", "eval.every=2"]
    )
    config.run_dir.mkdir(parents=True)
    (config.run_dir / "config.yaml").write_text(dump_config(config))
    serde, producer = default_serde(), kafka.producer("trk")
    expected: dict[str, dict[int, float]] = {}
    for v in range(VERSIONS):
        wv = make_weight_version(v)
        wv.run_id, wv.samples_trained = run, 16 * v
        wv.kind = WeightVersionKind.FINAL if v == VERSIONS - 1 else WeightVersionKind.UPDATE
        wv.metrics = {
            "loss": 0.5 - 0.1 * v,
            "reward_mean": 0.2 + 0.1 * v,
            "version_lag_mean": 0.75,
            "samples_per_s": 100.0 + v,
        }
        producer.produce(names[WEIGHT_VERSIONS], serde.encode(wv), key=run)
        for k, value in wv.metrics.items():
            expected.setdefault(f"train/{k}", {})[v] = value
        expected.setdefault("train/samples_trained", {})[v] = float(16 * v)
    for v in (0, 2, 4):
        ev = make_eval_result(v)
        ev.run_id, ev.pass_at_1, ev.pass_at_k = run, 0.25 + v / 10, 0.5 + v / 10
        producer.produce(names[EVAL_RESULTS], serde.encode(ev), key=run)
        expected.setdefault("eval/held-out/pass_at_1", {})[v] = ev.pass_at_1
        expected.setdefault("eval/held-out/pass_at_2", {})[v] = ev.pass_at_k
        expected.setdefault("eval/held-out/off_version_token_frac", {})[v] = ev.off_version_token_frac
    producer.flush()
    producer.close()
    return run, runs_dir, expected


def track(run: str, runs_dir: Path, bootstrap: str, *args: str) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(
        [sys.executable, "-m", "stream_rl.cli", "track", "--run", run, "--runs-dir", str(runs_dir), "--bootstrap", bootstrap, *args],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "WANDB_SILENT": "true"},
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"track: {VERSIONS} versions of run {run}" in res.stdout
    return res


def test_tensorboard_event_files_hold_the_topics_values(
    tracked_run: Any, kafka_bootstrap: str, tmp_path: Path
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, runs_dir, expected = tracked_run
    track(run, runs_dir, kafka_bootstrap, "--to", "tensorboard", "--tensorboard-dir", str(tmp_path))
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    for name, want in expected.items():
        assert {e.step: e.value for e in acc.Scalars(name)} == pytest.approx(want, rel=1e-6), name
    assert "config/text_summary" in acc.Tags()["tensors"]


def wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf records of a W&B `.wandb` transaction log (LevelDB log format: 32 KiB blocks,
    7-byte record headers crc32/length/type, after a 7-byte `:W&B` file header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            yield pb.Record.FromString(pending)
            pending = b""


def test_wandb_sink_backfills_the_run_offline(tracked_run: Any, kafka_bootstrap: str, tmp_path: Path) -> None:
    run, runs_dir, expected = tracked_run
    track(run, runs_dir, kafka_bootstrap, "--to", "wandb", "--wandb-dir", str(tmp_path))
    (log,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    rows: dict[int, dict[str, float]] = {}
    config: dict[str, Any] = {}
    for record in wandb_records(log):
        if record.HasField("history"):
            row = {
                (item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                for item in record.history.item
            }
            rows.setdefault(int(row["version"]), {}).update(row)
        elif record.HasField("config"):
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
    for name, want in expected.items():
        assert {v: r[name] for v, r in rows.items() if name in r} == pytest.approx(want), name
    assert config["trainer.max_steps"] == 1000 and config["eval.every"] == 2


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    import httpx

    tmp = tmp_path_factory.mktemp("mlflow")
    from stream_rl.common.ports import free_port

    port = free_port()
    with open(tmp / "server.log", "wb") as log:  # the server keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{tmp}/mlflow.db",
             "--default-artifact-root", str(tmp / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
             "--workers", "1"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp / "server.log").read_text()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "MLflow server not up in 180 s"
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_mlflow_sink_backfills_the_run_into_a_real_server(
    tracked_run: Any, kafka_bootstrap: str, mlflow_server: str
) -> None:
    import httpx

    run_name, runs_dir, expected = tracked_run
    track(
        run_name,
        runs_dir,
        kafka_bootstrap,
        "--to",
        "mlflow",
        "--mlflow-uri",
        mlflow_server,
        "--experiment",
        "e2e",
    )
    api = f"{mlflow_server}/api/2.0/mlflow"
    exp = httpx.get(f"{api}/experiments/get-by-name", params={"experiment_name": "e2e"}).json()["experiment"]
    runs = httpx.post(f"{api}/runs/search", json={"experiment_ids": [exp["experiment_id"]]}).json()["runs"]
    (run,) = [r for r in runs if r["info"]["run_name"] == run_name]
    run_id = run["info"]["run_id"]
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    assert params["trainer.max_steps"] == "1000" and params["task.name"] == "arithmetic"
    for name, want in expected.items():
        history = httpx.get(
            f"{api}/metrics/get-history", params={"run_id": run_id, "metric_key": name}
        ).json()
        assert {m["step"]: m["value"] for m in history["metrics"]} == pytest.approx(want), name
