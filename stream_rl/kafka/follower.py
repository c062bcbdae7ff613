"""Follow the run's `weight-versions` topic from the start (no consumer group, nothing committed).

The actor (admission), the preprocessor (backpressure) and the launcher (progress) each need
the latest `WeightVersion`; a background thread keeps it, and `wait_for()` blocks until a
version (or a samples-consumed count) is reached. Kafka replaces PipelineRL's "read the trainer
topic from offset 0" with the same semantics and a durable, replayable log.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from stream_rl.contracts import Contract, WeightVersion
from stream_rl.errors import ContractError
from stream_rl.kafka.serde import Serde, default_serde
from stream_rl.kafka.topics import WEIGHT_VERSIONS, TopicNames
from stream_rl.kafka.transport import Transport

log = logging.getLogger(__name__)

C = TypeVar("C", bound=Contract)


class VersionFollower:
    """Keeps the latest `WeightVersion` of a run. With `keep_history`, `drain()` hands over every
    one seen since the last call, in order (the caller keeps what it needs: a run of any length
    costs the follower no memory)."""

    def __init__(
        self,
        transport: Transport,
        names: TopicNames,
        client_id: str = "version-follower",
        serde: Serde | None = None,
        on_version: Callable[[WeightVersion], None] | None = None,
        keep_history: bool = False,
    ) -> None:
        self._transport = transport
        self._topic = names.topic(WEIGHT_VERSIONS)
        self._client_id = client_id
        self._serde = serde or default_serde()
        self._on_version = on_version
        self._keep_history = keep_history
        self._cond = threading.Condition()
        self._latest: WeightVersion | None = None
        self._pending: list[WeightVersion] = []
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"{client_id}-thread", daemon=True)

    def start(self) -> VersionFollower:
        self._thread.start()
        return self

    def _run(self) -> None:
        consumer = self._transport.consumer(None, self._client_id)
        try:
            consumer.assign({(self._topic, 0): 0})
            while not self._stop.is_set():
                for msg in consumer.poll_batch(100, 0.2):
                    try:
                        wv = self._serde.decode(msg.value, WeightVersion)
                    except ContractError as exc:
                        log.error("skipping undecodable weight-versions record @%d: %s", msg.offset, exc)
                        continue
                    with self._cond:
                        if self._latest is None or wv.version >= self._latest.version:
                            self._latest = wv
                        if self._keep_history:
                            self._pending.append(wv)
                        self._cond.notify_all()
                    if self._on_version:
                        self._on_version(wv)
        except BaseException as exc:  # noqa: BLE001 - surfaced to the owner through latest()/wait_for()
            self._error = exc
            with self._cond:
                self._cond.notify_all()
        finally:
            consumer.close()

    def drain(self) -> list[WeightVersion]:
        """The versions seen since the last call (with `keep_history`), oldest first."""
        with self._cond:
            out, self._pending = self._pending, []
        return out

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    @property
    def latest(self) -> WeightVersion | None:
        self._check()
        with self._cond:
            return self._latest

    def wait_for(
        self, predicate: Callable[[WeightVersion | None], bool], timeout: float | None = None
    ) -> bool:
        """Block until `predicate(latest)` holds; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not predicate(self._latest):
                self._check()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(0.5 if left is None else min(left, 0.5))
        return True

    def wait_for_version(self, version: int, timeout: float | None = None) -> bool:
        return self.wait_for(lambda wv: wv is not None and wv.version >= version, timeout)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


class RecordFollower(Generic[C]):
    """Follows one single-partition topic of contract records from the start (no group): `records`
    holds the last `keep` records decoded, in log order; with `keep_history`, `drain()` hands over
    every one decoded since the last call (the caller keeps what it needs: a follower costs the same
    memory after a thousand evaluations as after one). Undecodable records are logged and skipped.
    The launcher, the trainer (`eval.pin`) and the trackers follow `eval-results` with it."""

    def __init__(
        self,
        transport: Transport,
        topic: str,
        cls: type[C],
        client_id: str,
        serde: Serde | None = None,
        on_record: Callable[[C], None] | None = None,
        keep: int = 64,
        keep_history: bool = False,
    ) -> None:
        self._transport = transport
        self._topic = topic
        self._cls = cls
        self._client_id = client_id
        self._serde = serde or default_serde()
        self._on_record = on_record
        self._keep_history = keep_history
        self._lock = threading.Lock()
        self._records: deque[C] = deque(maxlen=keep)
        self._pending: list[C] = []
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"{client_id}-thread", daemon=True)

    def start(self) -> RecordFollower[C]:
        self._thread.start()
        return self

    def _run(self) -> None:
        consumer = self._transport.consumer(None, self._client_id)
        try:
            consumer.assign({(self._topic, 0): 0})
            while not self._stop.is_set():
                for msg in consumer.poll_batch(100, 0.2):
                    try:
                        record = self._serde.decode(msg.value, self._cls)
                    except ContractError as exc:
                        log.error("skipping undecodable %s record @%d: %s", self._topic, msg.offset, exc)
                        continue
                    with self._lock:
                        self._records.append(record)
                        if self._keep_history:
                            self._pending.append(record)
                    if self._on_record:
                        self._on_record(record)
        except BaseException as exc:  # noqa: BLE001 - surfaced to the owner through `records`
            self._error = exc
        finally:
            consumer.close()

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    @property
    def records(self) -> list[C]:
        """The last `keep` records decoded, oldest first."""
        self._check()
        with self._lock:
            return list(self._records)

    def drain(self) -> list[C]:
        """The records decoded since the last call (with `keep_history`), oldest first."""
        self._check()
        with self._lock:
            out, self._pending = self._pending, []
        return out

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
