"""The trainer stage with `trainer.lora` (dropout on) on the in-memory transport: adapters trained only (the
optimizer's state and the checkpoint hold them, nothing else), the served weights are the merged
ones (version 0: the base exactly), and a stopped-and-resumed run and `replay trainer` give the
uninterrupted run's checksums bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fakes.training import FakePusher, make_batches, make_tiny_model, produce_batches, setup_topics
from fakes.training import stage_config as make_config

from stream_rl.contracts import WeightVersion
from stream_rl.kafka.memory import MemoryTransport
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.topics import WEIGHT_VERSIONS, TopicNames
from stream_rl.stages import trainer as trainer_stage
from stream_rl.train.backends import build_trainer
from stream_rl.train.checkpoint import latest_checkpoint
from stream_rl.train.lora import LoraTrainer
from stream_rl.train.replay_trainer import replay_trainer
from stream_rl.weights.checksum import weights_checksum
from stream_rl.weights.lora import adapters_of, merge

pytestmark = pytest.mark.unit

SERDE = default_serde()
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"], "dropout": 0.1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def checksums(transport: MemoryTransport, names: TopicNames) -> list[str]:
    msgs = transport.messages(names.topic(WEIGHT_VERSIONS))
    return [SERDE.decode(m.value, WeightVersion).checksum for m in msgs]


def test_a_lora_run_trains_adapters_only_and_resumes_and_replays_exactly(
    tmp_path: Path, model_dir: Path
) -> None:
    batches = make_batches(8, 2, seed=5)
    # Uninterrupted, with a pusher that records what it was handed.
    ref_transport = MemoryTransport()
    ref_names = setup_topics(ref_transport, "ref", batches)
    pusher = FakePusher()
    ref_cfg = make_config(tmp_path / "ref", model_dir, run="ref", lora=LORA, lr=1e-2)
    trainer_stage.run(ref_cfg, ref_transport, pusher=pusher, idle_timeout_s=0.5)
    ref = checksums(ref_transport, ref_names)
    assert len(ref) == 5 and len(set(ref)) == 5  # every step moved the merged weights
    plain = build_trainer(make_config(tmp_path / "plain", model_dir))
    assert ref[0] == plain.checksum()  # version 0: B = 0, the base model exactly

    # Stopped after two steps and a half, resumed from its checkpoint.
    transport = MemoryTransport()
    names = setup_topics(transport, "r1", batches[:5])
    cfg = make_config(tmp_path, model_dir, lora=LORA, lr=1e-2)
    assert trainer_stage.run(cfg, transport, idle_timeout_s=0.5).version == 2
    ckpt = latest_checkpoint(tmp_path / "runs" / "r1" / "trainer" / "checkpoints")
    assert ckpt is not None
    files = sorted(p.name for p in (ckpt / "model").iterdir())
    assert "adapter_model.safetensors" in files and "model.safetensors" not in files
    optimizer = torch.load(ckpt / "optimizer.pt", weights_only=True)
    # AdamW state for the adapters only: A and B of q_proj and v_proj in 2 layers.
    shapes = sorted(tuple(s["exp_avg"].shape) for s in optimizer["state"].values())
    assert len(shapes) == 8 and all(4 in shape for shape in shapes)
    produce_batches(transport, names, batches[5:])
    assert trainer_stage.run(cfg, transport, idle_timeout_s=0.5).version == 4
    assert checksums(transport, names) == ref

    # `replay trainer` re-trains the run from its topics: every version's checksum again.
    report = replay_trainer(cfg, transport, poll_timeout_s=1.0)
    assert report.ok, report.table()
    assert [r.replayed for r in report.rows] == ref


def test_the_merged_weights_change_only_the_targeted_layers(tmp_path: Path, model_dir: Path) -> None:
    transport = MemoryTransport()
    setup_topics(transport, "r1", make_batches(2, 2, seed=3))
    cfg = make_config(tmp_path, model_dir, lora=LORA, lr=1e-2, max_steps=1)
    trainer_stage.run(cfg, transport, idle_timeout_s=0.5)
    ckpt = latest_checkpoint(tmp_path / "runs" / "r1" / "trainer" / "checkpoints")
    assert ckpt is not None
    trainer = build_trainer(cfg, ckpt / "model")  # base from model.path, adapters from the checkpoint
    base = dict(build_trainer(make_config(tmp_path / "b", model_dir)).model.named_parameters())
    with trainer.full_weights() as named:
        lora = adapters_of(named)
        assert lora is not None and lora.scale == 2.0
        pairs = {name: (a, b) for name, a, b in lora.pairs}
        assert sorted(pairs) == sorted(
            f"model.layers.{i}.self_attn.{m}.weight" for i in range(2) for m in ("q_proj", "v_proj")
        )
        assert [n for n, _ in named] == list(base)
        for name, tensor in named:
            if name in pairs:
                assert not torch.equal(tensor, base[name]), name
                assert torch.equal(tensor, merge(base[name].detach(), *pairs[name], 2.0)), name
            else:
                assert torch.equal(tensor, base[name]), name
        assert weights_checksum(named) == trainer.checksum()
    # trainer.lora.dropout is in force while training: the adapters' input is noised (two forward
    # passes differ), the rest of the model stays in eval mode.
    assert isinstance(trainer, LoraTrainer)
    sample = make_batches(1, 2, seed=9)[0].samples
    assert not torch.equal(trainer.logprobs(sample), trainer.logprobs(sample))
    assert not trainer.model.training
    # `export model` of a LoRA run: a plain HF directory holding the merged weights.
    from transformers import AutoModelForCausalLM

    trainer.save_merged(tmp_path / "merged", model_dir, "float32")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert weights_checksum([(n, p.detach()) for n, p in plain.named_parameters()]) == trainer.checksum()
