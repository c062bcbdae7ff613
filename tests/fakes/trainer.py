"""A fake trainer for pipeline tests (the real one is built elsewhere): it consumes
`training-batches` like the trainer does and publishes `WeightVersion`s, without a model.

It publishes version 0 (`kind: init`) at start; then, whenever the whole micro-batches it has
consumed since its last step hold at least `samples_per_step` samples (trained + filtered), it
"steps": records each sample's version lag (its weights version minus the sample's min sampling
version), calls `set_version(v + 1)` (servers install a version before it is published, as with
the real trainer), and publishes version v + 1 with the cumulative counts and its consumed offset.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from stream_rl.contracts import PartitionOffset, TrainingBatch, WeightVersion, WeightVersionKind
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.stage import StopFlag
from stream_rl.kafka.topics import TRAINING_BATCHES, WEIGHT_VERSIONS, TopicNames
from stream_rl.kafka.transport import Transport


class FakeTrainer(threading.Thread):
    def __init__(
        self,
        transport: Transport,
        names: TopicNames,
        samples_per_step: int,
        set_version: Callable[[int], None],
        max_steps: int,
    ) -> None:
        super().__init__(name="fake-trainer", daemon=True)
        self.transport = transport
        self.names = names
        self.samples_per_step = samples_per_step
        self.set_version = set_version
        self.max_steps = max_steps
        self.stop = StopFlag()
        self.version = 0
        self.trained: list[tuple[str, int]] = []
        """(rollout_id, lag) of every trained sample."""
        self.steps: list[list[str]] = []
        self.samples_trained = 0
        self.samples_filtered = 0
        self.error: BaseException | None = None
        self.finished = threading.Event()

    def publish(self, kind: WeightVersionKind, offset: int) -> None:
        wv = WeightVersion(
            run_id=self.names.run,
            version=self.version,
            step=self.version,
            kind=kind,
            samples_trained=self.samples_trained,
            tokens_trained=0,
            checksum="fake",
            samples_filtered=self.samples_filtered,
            consumed_offsets=[PartitionOffset(self.names[TRAINING_BATCHES], 0, offset)],
        )
        producer = self.transport.producer("fake-trainer")
        producer.produce(self.names[WEIGHT_VERSIONS], default_serde().encode(wv), key=self.names.run)
        producer.flush()
        producer.close()

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - reported to the test through .error
            self.error = exc
        finally:
            self.finished.set()

    def _run(self) -> None:
        serde = default_serde()
        topic = self.names[TRAINING_BATCHES]
        self.publish(WeightVersionKind.INIT, 0)
        consumer = self.transport.consumer(self.names.group("trainer"), "fake-trainer")
        consumer.subscribe([topic])
        step: list[TrainingBatch] = []
        try:
            while not self.stop and len(self.steps) < self.max_steps:
                for msg in consumer.poll_batch(50, 0.1):
                    step.append(serde.decode(msg.value, TrainingBatch))
                    if sum(b.num_samples + b.num_filtered for b in step) < self.samples_per_step:
                        continue
                    samples = [s for b in step for s in b.samples]
                    for s in samples:
                        self.trained.append(
                            (s.rollout_id, self.version - min(sp.version for sp in s.version_spans))
                        )
                    self.steps.append([s.rollout_id for s in samples])
                    self.samples_trained += len(samples)
                    self.samples_filtered += sum(b.num_filtered for b in step)
                    step = []
                    self.version += 1
                    self.set_version(self.version)
                    consumer.commit({(topic, msg.partition): msg.offset + 1})
                    self.publish(WeightVersionKind.UPDATE, msg.offset + 1)
                    if len(self.steps) >= self.max_steps:
                        break
        finally:
            consumer.close()
