"""Helpers of the stage integration tests (real broker): configs, reading topics, group membership,
running a stage in a thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from fakes.records import make_weight_version

from stream_rl.config import RunConfig
from stream_rl.kafka.confluent import KafkaTransport
from stream_rl.kafka.reader import read_to_end
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.stage import StageStats, StopFlag
from stream_rl.kafka.topics import WEIGHT_VERSIONS, TopicNames
from stream_rl.kafka.transport import Message


def make_config(names: TopicNames, bootstrap: str, **sections: Any) -> RunConfig:
    data: dict[str, Any] = {
        "run": names.run,
        "kafka": {"bootstrap": bootstrap, "prefix": names.prefix},
        "task": {"name": "arithmetic", "params": {"num_problems": 8}},
        "actor": {"group_size": 4, "max_lag": 1, "backoff_s": 0.01, "refresh_s": 0.5},
        "verifier": {"workers": 0},
        "preprocessor": {"batch_size": 16},
        "trainer": {"samples_per_step": 1024},
        "inference": {"servers": [{"url": "http://fake-a"}, {"url": "http://fake-b"}]},
    }
    for section, values in sections.items():
        if isinstance(values, dict) and isinstance(data.get(section), dict):
            data[section] = {**data[section], **values}
        else:
            data[section] = values
    return RunConfig.model_validate(data)


def read(kafka: KafkaTransport, topic: str) -> list[Message]:
    """Every committed record of `topic`, once every transaction in it is decided and marked
    (`reader.settled`): read right after a stage's last commit, a read to the last stable offset
    missed its last batches (a clean-clone CI run: 16 of 24 samples)."""
    return list(read_to_end(kafka, topic, client_id="test-reader", settle_s=30))


def wait_for(predicate: Callable[[], bool], timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def count(kafka: KafkaTransport, topic: str) -> int:
    return sum(high - low for low, high in kafka.watermarks(topic).values())


def publish_version(kafka: KafkaTransport, names: TopicNames, version: int = 0, consumed: int = 0) -> None:
    wv = replace(make_weight_version(version, run_id=names.run), samples_trained=consumed)
    p = kafka.producer("test-trainer")
    p.produce(names[WEIGHT_VERSIONS], default_serde().encode(wv), key=names.run)
    p.flush()


def assignments(kafka: KafkaTransport, group: str) -> list[list[tuple[str, int]]]:
    """The partitions of each member of a consumer group (as the broker sees them now)."""
    desc = kafka.admin.describe_consumer_groups([group], request_timeout=10)[group].result()
    return [[(tp.topic, tp.partition) for tp in m.assignment.topic_partitions] for m in desc.members]


class StageThread(threading.Thread):
    """Runs `run(config, stop=..., instance=..., **kw)` of a stage; keeps its stats or error."""

    def __init__(
        self, run: Callable[..., StageStats], config: RunConfig, instance: int = 0, **kw: Any
    ) -> None:
        super().__init__(name=f"stage-{instance}", daemon=True)
        self.stop_flag = StopFlag()
        self._call = lambda: run(config, stop=self.stop_flag, instance=instance, **kw)
        self.stats: StageStats | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.stats = self._call()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.error = exc

    def finish(self, timeout: float = 60.0) -> StageStats:
        self.stop_flag.set("test done")
        self.join(timeout)
        assert not self.is_alive(), "stage did not stop"
        if self.error is not None:
            raise self.error
        assert self.stats is not None
        return self.stats
