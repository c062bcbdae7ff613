"""How the Kafka clients live through a broker outage (a restart, a network blip) and stay quiet.

- **Wait it out.** Every call that needs the broker (admin calls, commits, transaction steps,
  flushes) retries errors that a broker coming back clears (`transient`) with exponential
  backoff (0.2 s doubling to 5 s) for up to `kafka.outage_timeout_s` (default 120 s), logging
  one line when it starts waiting and one when the broker answers again. Only then, or on an
  error no retry can clear (authorization, a missing topic, a fenced producer), does it raise
  `KafkaError`, a one-line message. librdkafka itself reconnects and re-sends produced records
  (idempotent producers: no duplicates) on its own.
- **A broker that never answered is a mistake, not an outage.** `check_reachable` (run by the
  stage commands and the launcher before anything else) fails within seconds with one line
  naming the address, instead of librdkafka's connection retries.
- **librdkafka's log lines go through Python logging, rate-limited** (`ClientLog`): the first
  line of each kind per client is logged, repeats within 30 s are counted and summarized, so a
  10-second outage costs a few lines instead of hundreds of `Connection refused`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import confluent_kafka as ck

log = logging.getLogger("stream_rl.kafka")
T = TypeVar("T")

DEFAULT_OUTAGE_S = 120.0
REACHABLE_WAIT_ENV = "STREAM_RL_KAFKA_REACHABLE_WAIT_S"
"""How long `check_reachable` waits (default 10 s); the launcher gives its children the outage
timeout, since it has reached the broker itself."""


def reachable_wait_s(default: float = 10.0) -> float:
    import os

    try:
        return float(os.environ.get(REACHABLE_WAIT_ENV, default))
    except ValueError:
        return default


BACKOFF_FIRST_S = 0.2
BACKOFF_MAX_S = 5.0

_K = ck.KafkaError
PERMANENT = frozenset(
    {
        _K.TOPIC_AUTHORIZATION_FAILED,
        _K.GROUP_AUTHORIZATION_FAILED,
        _K.CLUSTER_AUTHORIZATION_FAILED,
        _K.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
        _K.INVALID_CONFIG,
        _K.INVALID_REQUEST,
        _K.UNSUPPORTED_VERSION,
        _K.INVALID_PRODUCER_EPOCH,
        _K.PRODUCER_FENCED,
        _K._FENCED,
        _K.FENCED_INSTANCE_ID,
        _K.UNKNOWN_MEMBER_ID,
        _K.ILLEGAL_GENERATION,
        _K.REBALANCE_IN_PROGRESS,
        _K._INVALID_ARG,
        _K._STATE,
        _K._NOT_IMPLEMENTED,
        _K.TOPIC_ALREADY_EXISTS,
        _K.UNKNOWN_TOPIC_OR_PART,
        _K._UNKNOWN_TOPIC,
        _K._UNKNOWN_PARTITION,
        _K.MSG_SIZE_TOO_LARGE,
        _K.RECORD_LIST_TOO_LARGE,
    }
)
"""Errors a broker coming back does not clear: raised at once."""


def transient(err: Any) -> bool:
    """Whether retrying can clear `err` (a confluent_kafka.KafkaError): anything but a fatal error
    or one of `PERMANENT`. Broad on purpose: during a restart the broker answers with leadership,
    coordinator, epoch and transport errors that not every call flags as retriable."""
    if not isinstance(err, ck.KafkaError):
        return False
    if err.fatal():
        return False
    return err.code() not in PERMANENT


class Backoff:
    """Exponential backoff with a deadline, logging the start and the end of a wait."""

    def __init__(self, what: str, limit_s: float) -> None:
        self.what = what
        self.deadline = time.monotonic() + limit_s
        self.limit_s = limit_s
        self.delay = BACKOFF_FIRST_S
        self.started: float | None = None

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def wait(self, error: str) -> bool:
        """Sleep before the next try; False when the deadline has passed (the caller raises)."""
        if self.left() <= 0:
            return False
        if self.started is None:
            self.started = time.monotonic()
            log.warning(
                "%s: %s; retrying for up to %.0fs (is the broker restarting?)", self.what, error, self.limit_s
            )
        time.sleep(min(self.delay, max(self.left(), 0.0)))
        self.delay = min(self.delay * 2, BACKOFF_MAX_S)
        return True

    def done(self) -> None:
        if self.started is not None:
            log.warning(
                "%s: the broker answers again after %.1fs", self.what, time.monotonic() - self.started
            )


def retry(fn: Callable[[], T], what: str, limit_s: float, fail: Callable[[str, Any], Exception]) -> T:
    """`fn()`, retried on transient errors for up to `limit_s`; `fail(what, exc)` builds the error
    raised otherwise."""
    backoff = Backoff(what, limit_s)
    while True:
        try:
            out = fn()
        except ck.KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if transient(err) and backoff.wait(err.str() if isinstance(err, ck.KafkaError) else str(exc)):
                continue
            raise fail(what, exc) from exc
        except TransientKafkaError as exc:
            if backoff.wait(str(exc)):
                continue
            raise fail(what, exc) from exc
        backoff.done()
        return out


class TransientKafkaError(Exception):
    """Raised inside a retried call for a condition the broker coming back clears (e.g. a topic
    whose partitions have no leader yet)."""


class ClientLog(logging.Logger):
    """librdkafka's log callback (the `logger` client setting), rate-limited per client and kind:
    the first line of a kind is logged, repeats within `every_s` are counted into the next one."""

    def __init__(self, name: str = "stream_rl.kafka.confluent", every_s: float = 30.0) -> None:
        super().__init__(name)
        self.target = logging.getLogger("stream_rl.kafka")
        self.every_s = every_s
        self._last: dict[tuple[str, str], tuple[float, int]] = {}
        self._lock = threading.Lock()

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:  # noqa: D102
        fac, client = (str(args[0]), str(args[1])) if len(args) >= 2 else ("", "")
        now = time.monotonic()
        with self._lock:
            last, skipped = self._last.get((fac, client), (-1e18, 0))
            if now - last < self.every_s:
                self._last[(fac, client)] = (last, skipped + 1)
                return
            self._last[(fac, client)] = (now, 0)
        text = str(msg) % args if args else str(msg)
        if skipped:
            text += f" (and {skipped} more like it in the last {self.every_s:.0f}s)"
        # librdkafka's levels are syslog's mapped onto logging's; its errors during an outage are
        # expected, so they are warnings here.
        self.target.log(min(level, logging.WARNING), "librdkafka: %s", text)


CLIENT_LOG = ClientLog()
