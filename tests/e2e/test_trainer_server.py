"""The trainer end to end with a real broker and a real inference server (tiny model, gloo):
synthetic training batches in, N versions out; after every push the server's own parameters
have the checksum the trainer published; `weight-versions` holds 0..N in order."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes.server_thread import ServerThread
from fakes.training import make_batches, produce_batches, stage_config
from transformers import AutoConfig

from stream_rl.contracts import WeightVersionKind
from stream_rl.kafka.topics import TopicNames
from stream_rl.stages import trainer as trainer_stage
from stream_rl.train.lineage import read_weight_versions
from stream_rl.train.push import PushOutcome, make_sender
from stream_rl.weights.checksum import weights_checksum

pytestmark = pytest.mark.e2e

TOKEN = "e2e-token"
STEPS = 4


class CheckingPusher:
    """The real `WeightSender`; after each push, checksums the parameters the server now serves."""

    def __init__(self, sender: Any, engine: Any) -> None:
        self.sender = sender
        self.engine = engine
        self.served: list[tuple[int, int, str]] = []
        """(version pushed, version the engine reports, checksum of the engine's parameters)."""

    @property
    def live_servers(self) -> list[str]:
        return list(self.sender.live_servers)

    def connect(self) -> dict[str, str]:
        return dict(self.sender.connect())

    def push(self, version: int, named_tensors: Sequence[tuple[str, Any]], bucket_bytes: int) -> PushOutcome:
        report: PushOutcome = self.sender.push(version, named_tensors, bucket_bytes)
        params = self.engine.parameters
        served = weights_checksum([(s.name, params.get(s.name)) for s in params.specs()])
        self.served.append((version, int(self.engine.version), served))
        return report

    def close(self) -> None:
        self.sender.close()


def test_trainer_updates_a_real_server_every_step(  # type: ignore[no-untyped-def]
    kafka, kafka_bootstrap: str, run_names: TopicNames, tmp_path: Path
) -> None:
    from stream_rl.inference.engine import Engine
    from stream_rl.inference.model_maker import make_model

    model = make_model(tmp_path / "model", "tiny", seed=0)
    vocab = int(AutoConfig.from_pretrained(model).vocab_size)
    produce_batches(kafka, run_names, make_batches(2 * STEPS, 2, seed=41, vocab_size=vocab))
    engine = Engine.load(model, dtype="float32", max_batch=4)
    with ServerThread(engine, admin_token=TOKEN) as server:
        config = stage_config(tmp_path, model, run=run_names.run, max_steps=STEPS, bucket_mb=0.05)
        config = config.model_validate(
            {
                **config.model_dump(),
                "kafka": {"bootstrap": kafka_bootstrap},
                "inference": {"servers": [{"url": server.url}], "admin_token": TOKEN},
                "trainer": {**config.trainer.model_dump(), "sync_master_port": 0},
            }
        )
        pusher = CheckingPusher(make_sender(config), engine)
        stats = trainer_stage.run(config, kafka, pusher=pusher, idle_timeout_s=30)
        health = httpx.get(f"{server.url}/health").json()

    assert stats.stopped_by == "max_steps" and stats.version == STEPS
    versions = read_weight_versions(kafka, run_names)
    assert [w.version for w in versions] == list(range(STEPS + 1))
    assert versions[0].kind == WeightVersionKind.INIT and versions[-1].kind == WeightVersionKind.FINAL
    assert all(w.servers_updated == [server.url] and not w.servers_failed for w in versions)
    assert all(w.broadcast_ms > 0 for w in versions)
    # The server holds exactly the trainer's weights after every push, version 0 included.
    assert pusher.served == [(w.version, w.version, w.checksum) for w in versions]
    assert len({w.checksum for w in versions}) == STEPS + 1
    assert health["version"] == STEPS
