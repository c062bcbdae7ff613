"""The FSDP2 backend (`trainer.backend: fsdp2`, `torch.distributed.fsdp.fully_shard`) with two CPU
ranks over gloo, launched with torchrun as the trainer stage on a real broker: same lineage, losses
and gradient norms as the torch backend, and the same weights up to rounding (the reduce-scatter
sums in another order: not bit for bit). Stopped after two versions and resumed from its sharded
`torch.distributed.checkpoint`. The torch reference is trained once per module. The `gpu` variant
runs the same on CUDA with NCCL (never run here: no GPU)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from fakes.training import make_batches, make_tiny_model, produce_batches, stage_config
from safetensors.torch import load_file

from stream_rl.common.ports import free_port
from stream_rl.contracts import TrainingBatch, WeightVersion
from stream_rl.kafka.confluent import KafkaTransport
from stream_rl.kafka.topics import TopicNames, apply_topics
from stream_rl.stages import trainer as trainer_stage
from stream_rl.train.checkpoint import latest_checkpoint
from stream_rl.train.lineage import read_weight_versions
from stream_rl.train.step import load_model
from stream_rl.weights.checksum import weights_checksum

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
COMMON: dict[str, object] = {"samples_per_step": 6, "checkpoint_every": 100}
FINAL_VERSION = 3
"""20 samples consumed (18 trained, 2 filtered) at 6 per step: versions 1..3, 2 samples left over."""


LAUNCH_TIMEOUT_S = 300
"""Per torchrun launch (one runs in ~15 s here); a hung launch is killed with its ranks."""


@dataclass
class Reference:
    """The torch backend's run on the same batches: the model, the batches, its lineage and last
    checkpoint's weights."""

    model: Path
    batches: list[TrainingBatch]
    lineage: list[WeightVersion]
    weights: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def reference(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    kafka = KafkaTransport(kafka_bootstrap)
    tmp = tmp_path_factory.mktemp("fsdp-ref")
    model = make_tiny_model(tmp / "model")
    # 3 micro-batches per step: with two ranks, rank 0 trains two, rank 1 one and a zero-weight pass.
    batches = make_batches(9, 2, seed=31, filtered_every=4)
    names = TopicNames(run=f"fsdpref{uuid.uuid4().hex[:10]}")
    apply_topics(kafka, names)
    produce_batches(kafka, names, batches)
    cfg = stage_config(tmp / "ref", model, run=names.run, **COMMON)
    trainer_stage.run(cfg, kafka, max_steps=FINAL_VERSION)
    ckpt = latest_checkpoint(tmp / "ref" / "runs" / names.run / "trainer" / "checkpoints")
    assert ckpt is not None
    return Reference(
        model, batches, read_weight_versions(kafka, names), load_file(ckpt / "model" / "model.safetensors")
    )


def torchrun(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run the launcher in its own session; on timeout kill the whole group (the ranks too, which a
    plain `subprocess.run` timeout would leave running, orphaned)."""
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun timed out after {LAUNCH_TIMEOUT_S}s: {out[-3000:]}{err[-5000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _last_model(tmp_path: Path, names: TopicNames) -> Path:
    ckpt = latest_checkpoint(tmp_path / "runs" / names.run / "trainer" / "checkpoints")
    assert ckpt is not None
    return ckpt / "model"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu, id="cuda-nccl")])
def test_two_ranks_match_the_torch_backend(
    kafka: KafkaTransport,
    kafka_bootstrap: str,
    run_names: TopicNames,
    tmp_path: Path,
    reference: Reference,
    device: str,
) -> None:
    ranks = 2 if device == "cpu" else min(2, torch.cuda.device_count())
    if ranks < 1:
        pytest.skip("no CUDA device")
    produce_batches(kafka, run_names, reference.batches)
    ref = reference.lineage
    cfg = stage_config(tmp_path, reference.model, run=run_names.run, backend="fsdp2", device=device, **COMMON)
    data = cfg.model_dump(mode="json")
    data["kafka"]["bootstrap"] = kafka_bootstrap
    config_path = tmp_path / "run.yaml"
    config_path.write_text(yaml.safe_dump(data))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    # Two lives: stop after version 2 (checkpoint), then resume from the sharded checkpoint.
    for bound in (2, FINAL_VERSION):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
            str(free_port()), "-m", "stream_rl.cli", "trainer", "--config", str(config_path),
            "--max-steps", str(bound),
        ]  # fmt: skip
        res = torchrun(cmd, env)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert "resuming from" in res.stderr and "step-000002" in res.stderr

    got = read_weight_versions(kafka, run_names)
    assert [w.version for w in got] == [w.version for w in ref] and len(got) == FINAL_VERSION + 1
    assert [(w.samples_trained, w.samples_filtered) for w in got] == [
        (w.samples_trained, w.samples_filtered) for w in ref
    ]
    assert got[0].checksum == ref[0].checksum  # same initial weights, same names and dtypes
    # Later checksums differ from the torch backend's (rounding, below); the pushed weights are
    # the checkpoint's: rank 0's gathered checksum is the saved model's.
    saved = load_model(ckpt_model := _last_model(tmp_path, run_names), "float32", "cpu")
    assert got[-1].checksum == weights_checksum([(n, p.detach()) for n, p in saved.named_parameters()])
    assert ckpt_model.parent.name == f"step-{FINAL_VERSION:06d}"
    for a, b in zip(got[1:], ref[1:], strict=True):
        assert a.metrics["loss"] == pytest.approx(b.metrics["loss"], rel=1e-4, abs=1e-6)
        assert a.metrics["ratio_mean"] == pytest.approx(b.metrics["ratio_mean"], rel=1e-5)
        assert a.metrics["grad_norm"] == pytest.approx(b.metrics["grad_norm"], rel=1e-4)
    ckpt = latest_checkpoint(tmp_path / "runs" / run_names.run / "trainer" / "checkpoints")
    assert ckpt is not None and (ckpt / "fsdp").is_dir()
    got_w = load_file(ckpt / "model" / "model.safetensors")
    ref_w = reference.weights
    assert got_w.keys() == ref_w.keys()
    moved = max(
        float((ref_w[k] - load_file(reference.model / "model.safetensors")[k]).abs().max()) for k in ref_w
    )
    assert moved > 1e-3  # training did change the weights, so the comparison below means something
    # As for DeepSpeed: Adam's update is nearly sign(gradient) * lr where gradients are tiny, so
    # reduction-order rounding can move single entries by a fraction of an update.
    for k in ref_w:
        assert torch.allclose(got_w[k], ref_w[k], atol=5e-5, rtol=0), k
