"""Hanging transactions (KIP-664) on a run's topics: found, and aborted.

A transaction is hanging on a partition when it is open there (the partition's last stable offset
stops at it) but its producer's transaction coordinator does not count it as in progress there:
no marker will ever come, every read_committed consumer of the partition stops before it for
good, and a group whose offsets it holds cannot read them ("Failed to get committed offsets:
Local: Timed out"). A broker's halt on a full disk left one (docs/faults.md): the preprocessor,
restarted, read nothing more and the run stalled. Kafka's remedy is `kafka-transactions.sh
find-hanging` and `abort`; librdkafka has no such calls, so this runs the broker's client jars on
`deploy/kafka/AbortHangingTransactions.java` (`stream_rl/kafka/java_admin.py`; PLAINTEXT brokers).

The launcher runs it (`HangingWatch`) once no weight version came for `CHECK_AFTER_S`, or once a
partition of a stage's output kept its last stable offset short of its log end that long (a hang on
one partition of several: the run goes on from the others until the held samples fill the actor's
admission window), and again every `EVERY_S` while either holds; `stream-rl hanging` runs it by
hand. Only transactions whose last write is `MIN_AGE_S` old are touched: past the producers'
transaction timeout (15 s, `stream_rl/kafka/producer.py`), after which a coordinator that knew the
transaction would have aborted it itself. On `__consumer_offsets`, shared with every other group of
the cluster, only a producer that also hangs on the run's own topics, or whose transactional id is
the run's, is aborted.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from stream_rl.config import KafkaConfig
from stream_rl.kafka.broker import DEPLOY_DIR
from stream_rl.kafka.java_admin import run_program
from stream_rl.kafka.topics import TopicNames

log = logging.getLogger(__name__)

PROGRAM = DEPLOY_DIR / "AbortHangingTransactions.java"
MIN_AGE_S = 30.0
"""Twice the producers' transaction timeout (15 s)."""
CHECK_AFTER_S = 40.0
EVERY_S = 30.0
OFFSETS_TOPIC = "__consumer_offsets"


def run_scope(names: TopicNames) -> tuple[list[str], str]:
    """(the run's own topics, its transactional-id prefix): what `find_hanging` looks at."""
    own = f"{names.prefix}.{names.run}."
    return [name for name, _parts, _conf in names.all_topics() if name.startswith(own)], own


def held_back(
    topic: str, stable: Mapping[int, tuple[int, int]], ends: Mapping[int, int]
) -> dict[tuple[str, int], int]:
    """The partitions of `topic` whose last stable offset (`stable`: watermarks as a read_committed
    reader gets them) stops short of their log end: (topic, partition) -> that offset. A
    transaction is open there, decided within its timeout (15 s) unless it hangs."""
    return {(topic, p): lso for p, (_low, lso) in stable.items() if lso < ends.get(p, lso)}


@dataclass
class Hanging:
    ran: bool
    lines: list[str] = field(default_factory=list)
    """One per open transaction found ("open ...", "hanging ...: aborted", ...)."""
    why: str = ""
    """Why it did not run or did not finish."""

    @property
    def hanging(self) -> list[str]:
        return [line for line in self.lines if line.startswith("hanging ")]

    @property
    def aborted(self) -> list[str]:
        return [line for line in self.hanging if line.endswith(": aborted")]

    def summary(self) -> str:
        if not self.ran:
            return f"hanging transactions: {self.why}"
        if not self.hanging:
            return "hanging transactions: none"
        return "; ".join(self.hanging)


def find_hanging(
    kafka: KafkaConfig,
    bootstrap: str,
    topics: list[str],
    *,
    transactional_prefix: str,
    abort: bool,
    min_age_s: float = MIN_AGE_S,
    timeout_s: float = 120.0,
) -> Hanging:
    """The open transactions on `topics` (and the run's on `__consumer_offsets`), the hanging ones
    aborted when `abort`. Never raises."""
    args = [
        str(int(min_age_s * 1000)),
        "abort" if abort else "check",
        transactional_prefix,
        *topics,
        f"+{OFFSETS_TOPIC}",
    ]
    res = run_program(kafka, bootstrap, PROGRAM, args, timeout_s)
    if not res.ran:
        return Hanging(False, why=res.why)
    lines = [line for line in res.lines if line.startswith(("open ", "hanging "))]
    if not any(line.startswith("checked ") for line in res.lines):
        return Hanging(False, lines, res.why or f"exit {res.returncode}")
    return Hanging(True, lines, "" if res.returncode == 0 else res.why)


class HangingWatch:
    """The launcher's check: `tick(now, version, held)` with the run's latest weight version and the
    partitions held back by an open transaction (`held_back`) starts `find_hanging(abort=True)` on
    a thread of its own once no new version came for `CHECK_AFTER_S`, or a partition stayed held
    at the same offset that long, at most every `EVERY_S`; `say` gets a line for each hanging
    transaction."""

    def __init__(
        self,
        kafka: KafkaConfig,
        bootstrap: str,
        topics: list[str],
        transactional_prefix: str,
        say: Callable[[str], None],
        min_age_s: float = MIN_AGE_S,
    ) -> None:
        self.kafka, self.bootstrap, self.topics = kafka, bootstrap, topics
        self.min_age_s = min_age_s
        self.prefix, self.say = transactional_prefix, say
        self._last = float("-inf")
        self._version: int | None = None
        self._since: float | None = None
        self._held: dict[tuple[str, int], tuple[int, float]] = {}
        """(topic, partition) -> (its last stable offset, since when it is held there)."""
        self.reason = ""
        self._thread: threading.Thread | None = None
        self.checks = 0
        self._warned = False
        self.aborted: list[str] = []

    def tick(
        self, now: float, version: int | None, held: Mapping[tuple[str, int], int] | None = None
    ) -> None:
        if self._since is None or version != self._version:
            self._since, self._version = now, version
        if held is not None:
            held_now: dict[tuple[str, int], tuple[int, float]] = {}
            for tp, lso in held.items():  # still held at the same offset: it keeps its start
                prev = self._held.get(tp)
                held_now[tp] = prev if prev is not None and prev[0] == lso else (lso, now)
            self._held = held_now
        stuck = sorted(
            f"{t} {p} at {lso}" for (t, p), (lso, since) in self._held.items() if now - since >= CHECK_AFTER_S
        )
        if now - self._last < EVERY_S or (now - self._since < CHECK_AFTER_S and not stuck):
            return
        if self._thread is not None and self._thread.is_alive():
            return
        self._last = now
        self.reason = (
            f"no weight version for {CHECK_AFTER_S:.0f}s"
            if now - self._since >= CHECK_AFTER_S
            else f"a last stable offset held for {CHECK_AFTER_S:.0f}s ({', '.join(stuck)})"
        )
        self._thread = threading.Thread(target=self._check, name="hanging-transactions", daemon=True)
        self._thread.start()

    def _check(self) -> None:
        found = find_hanging(
            self.kafka,
            self.bootstrap,
            self.topics,
            transactional_prefix=self.prefix,
            abort=True,
            min_age_s=self.min_age_s,
        )
        self.checks += 1
        log.debug("%s: %s", self.reason, found.summary())
        for line in found.hanging:
            if line.endswith(": aborted"):
                self.aborted.append(line)
            self.say(f"a hanging transaction (KIP-664) held the run: {line}")
        if not found.ran and not self._warned and "secured" not in found.why:
            self._warned = True  # once: it is tried again every EVERY_S while no version comes
            log.warning("could not look for hanging transactions (docs/operations.md): %s", found.why)

    def join(self, timeout_s: float = 5.0) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)
