"""Admission control: when may the actor start another problem's group?

Units are samples. S = `trainer.samples_per_step`, g = `actor.group_size`, L = `actor.max_lag`.

- R (resolved): `WeightVersion.samples_consumed` of the latest version seen (trained + filtered).
- A (admitted): the samples of every problem admitted so far in the run, by any actor:
  `g·(C − D) + g·U`, with C the problems the actor group has committed (Σ committed − low over
  the partitions of `problems`), D the records in `problems.dlq` (problems that yield no
  samples; C counts them too) and U the problems this actor admitted whose offsets are not yet
  committed. Being derived from Kafka, A survives restarts: a restarted actor redoes its
  uncommitted problems (downstream drops the duplicates), and C counts each problem once.
- In flight: A − R.

**Rule** (pipeline): admit a group when `A + g ≤ base + B`, with `B = (L + 1)·S` and `base = R`;
while a group this actor admitted earlier is still generating, `base` is the smallest R seen at
the admission of such a group, so no later group can push the window past a straggler. B is
raised to `ceil(S/g)·g` when smaller, so whole groups can always fill a step (no deadlock).
Nothing is admitted before version 0 (`kind: init`) is seen.

**Why the version lag stays ≤ L** (lag = version of the weights that train a sample − the
sample's min sampling version, as the trainer measures it). Let group G be admitted when the
latest version seen is k, published after R_k samples were consumed. Servers install a version
before the trainer publishes it, so G's tokens are sampled with versions ≥ k. The trainer reads
`training-batches` in order and steps once per S samples consumed, so the sample at stream
position q (0-based, trained and filtered samples counted) is trained with weights of version
≤ k + floor((q − R_k) / S). The samples consumed before G's come from groups admitted before G
(A ≤ R_k + B − g then), groups admitted while G generates (the straggler guard keeps
A ≤ R_k + B), and groups admitted after G's samples were produced that overtake them in the
verifier or preprocessor. Without that last kind, q < R_k + B = R_k + (L + 1)·S, so the weights
are ≤ k + L and the lag ≤ L. The last kind is real: groups are keyed to different partitions of
`raw-rollouts` and `scored`, so a group admitted just after G finished generating (a short
answer) can be scored and batched before G when G's partition is read a little later. When the
trainer is the bottleneck the window is always full, and one such overtaking at a step boundary
trains G at lag L + 1. Measured (`bench/pipeline_vs_conventional.py`, CPU demo, trainer-bound):
one group of 8 samples (two in one run) at lag 3 with L = 2 in each of 4 of 5 pipeline runs of
12,800 samples, about 0.1% of samples; none in 4 runs of the `small` model. The bound is
therefore an admission bound, as PipelineRL's `max_lag` is (its too-old samples are counted,
not dropped); the trainer measures and reports every sample's lag (`version_lag_max`). Making it
strict needs the actor to learn when a group is trained, or the trainer to take the oldest
samples of its backlog first; neither is built.

**Stragglers and `straggler_guard`.** With long, heavy-tailed completions one group can
generate for many optimizer steps while the others finish in one (`bench/pipeline_vs_conventional.py
--config configs/long-cpu.yaml`: up to ~10x). The guard (`actor.straggler_guard: true`, the
default) is what the proof above needs: while that group generates, the window cannot move, so
the servers decode it and the few groups admitted beside it, their other slots idle, until it
ends. `straggler_guard: false` is PipelineRL's admission: the base is always R, the window moves
with the trainer, and the servers stay full. What the bound then says: when a group finishes at
version k' (its last tokens are sampled with weights >= k', in flight), A <= R_k' + B, so it is
trained with weights <= k' + L: its **last** tokens' lag is at most L (up to the overtaking
above), its first tokens' lag at most L + d for a group that generated through d versions, and
the trainer reports both (`version_lag_max` from the oldest span, `version_lag_token_mean` per
token). With in-flight updates most of a long sample's tokens are sampled by recent weights,
which is the regime PipelineRL's paper measures. `tests/unit/test_admission.py` simulates a 10x
straggler both ways.

**Conventional** (`mode: conventional`): the same rule with L = 0 and B = S (a multiple of g, the
config checks it). The actor admits exactly S samples; then `A = R + S` blocks admission until
the trainer has consumed all of them, stepped and published version k + 1 (R only moves when a
version is published). The next S samples are sampled with version k + 1 and trained by step
k + 2 with weights k + 1: lag 0, every sample exactly on-policy.

**Several actors** share the bound by the partitions of `problems` they hold. The trainer
publishes what it consumed per partition (`WeightVersion.consumed_by_partition`: each rollout
carries the partition its problem came from), so an actor computes A and R over its own
partitions exactly (their committed offsets are its own commits, read again when a partition is
assigned to it; their dead letters are counted by the `original.partition` header) and admits
within its share, `B·owned/P` in whole groups (at least one group; a share below one group makes
the sum exceed B by the difference). The shares add up to B, so the samples in flight never exceed B, and a sample's **last** tokens are at most L versions old when
trained (up to the overtaking above): the guarantee `straggler_guard: false` gives. The first
tokens of a straggler are not bounded across actors: its guard holds its own actor's window, not
the others' (`tests/unit/test_admission.py` simulates two actors). One actor holding every
partition admits exactly as the group-wide rule below. A lineage without the per-partition
counts (started before they existed) keeps the group-wide rule: C and D include the other actors'
commits and dead letters (re-read every `actor.refresh_s`), each actor counts the others'
uncommitted problems as many as its own, `A = g·(C − D) + N·g·U` with N = `launcher.actors`, and
the view's staleness lets a fast run overshoot (measured: two actors, about 3 versions/s, L = 1:
samples trained up to 9-11 versions old); it is exact for one actor.
(`straggler_guard` makes no difference to R: it moves only once every admitted sample, the
straggler's included, has been trained.)
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from stream_rl.contracts import WeightVersion
from stream_rl.kafka.transport import Transport

Key = tuple[int, int]
"""A problem record: (partition, offset) in `problems`."""


def admission_bound(mode: str, max_lag: int, samples_per_step: int, group_size: int) -> int:
    """B: the most samples admitted but not resolved (see the module docstring); `max_lag` counts
    in pipeline mode only (`RunConfig.lag_bound`)."""
    lag = max_lag if mode == "pipeline" else 0
    whole_groups = math.ceil(samples_per_step / group_size) * group_size
    return max((lag + 1) * samples_per_step, whole_groups)


@dataclass(frozen=True)
class GroupView:
    """What Kafka says about the whole actor group (re-read every `actor.refresh_s`)."""

    committed: dict[int, int]
    """Committed offset per partition of `problems` (-1: none yet)."""
    low: dict[int, int]
    """Low watermark per partition of `problems`."""
    dlq: int
    """Records in `problems.dlq`."""
    members: int
    """Actor processes sharing the bound (`launcher.actors`)."""
    dlq_by_partition: dict[int, int] | None = None
    """`problems.dlq` records by the partition of `problems` they came from (their
    `original.partition` header)."""
    dlq_read: dict[int, int] | None = None
    """The next offset of each `problems.dlq` partition not yet counted in `dlq_by_partition`
    (the next view reads from there)."""


def read_group_view(
    transport: Transport,
    topic: str,
    dlq_topic: str,
    group: str,
    members: int = 1,
    previous: GroupView | None = None,
) -> GroupView:
    """The actor group's progress as the broker has it (broker calls: run it off the event loop).
    The DLQ's records are counted by their partition of origin; only those written since
    `previous` are read (before, every view re-read the whole DLQ whenever it had grown)."""
    marks = transport.watermarks(topic)
    committed = transport.group_offsets(group, topic)
    dlq_marks = transport.watermarks(dlq_topic)
    dlq = sum(high for _low, high in dlq_marks.values())
    by: dict[int, int] = {}
    since: dict[int, int] | None = None
    if previous is not None and previous.dlq_by_partition is not None and previous.dlq_read is not None:
        by, since = dict(previous.dlq_by_partition), previous.dlq_read
    for p, n in dlq_origins(transport, dlq_topic, since, dlq_marks).items():
        by[p] = by.get(p, 0) + n
    read = {p: high for p, (_low, high) in dlq_marks.items()}
    return GroupView(committed, {p: low for p, (low, _high) in marks.items()}, dlq, members, by, read)


class ViewRefresh:
    """When an actor re-reads the group view (`read_group_view`) into its `Admission`: at start,
    after a partition is assigned to it (its previous owner's last commits), and every
    `refresh_s` with several actors (one actor knows its own commits and dead letters: the view it
    read at start plus those is exact, and re-reading it costs the broker a few admin requests)."""

    def __init__(
        self, transport: Transport, topic: str, dlq_topic: str, group: str, members: int, refresh_s: float
    ) -> None:
        self.args = (transport, topic, dlq_topic, group, members)
        self.members, self.refresh_s = members, refresh_s
        self.view: GroupView | None = None
        self.assigned = False
        """Set (from the poll thread) when partitions are assigned."""
        self._last = 0.0

    def due(self, force: bool = False) -> bool:
        now = time.monotonic()
        return force or self.assigned or (self.members > 1 and now - self._last >= self.refresh_s)

    def read(self) -> GroupView:
        """Read the view (broker calls: off the event loop)."""
        self._last, self.assigned = time.monotonic(), False
        self.view = read_group_view(*self.args, previous=self.view)
        return self.view


def dlq_origins(
    transport: Transport,
    dlq_topic: str,
    since: dict[int, int] | None = None,
    marks: dict[int, tuple[int, int]] | None = None,
) -> dict[int, int]:
    """`problems.dlq`'s records by the partition of `problems` they came from (-1: no header),
    those from offsets `since` (all when None) up to `marks` (the watermarks now when None)."""
    from stream_rl.kafka.reader import read_to_end

    out: dict[int, int] = {}
    for msg in read_to_end(transport, dlq_topic, client_id="actor-dlq-origins", start=since, marks=marks):
        raw = msg.header("original.partition")
        p = int(raw) if raw is not None and raw.isdigit() else -1
        out[p] = out.get(p, 0) + 1
    return out


@dataclass
class _Open:
    resolved_at_admission: int
    generating: bool = True


@dataclass
class Admission:
    """The admission state of one actor. Thread-safe (rebalance callbacks run on the poll thread)."""

    group_size: int
    bound: int
    straggler_guard: bool = True
    """A group still generating holds the window's base at the R of its admission (see above)."""
    version: int | None = None
    resolved: int | None = None
    members: int = 1
    by_partition: dict[int, int] | None = None
    """The latest version's `consumed_by_partition` when every consumed sample is attributed (R per
    partition); None for a lineage without it (then the group-wide rule applies)."""
    owned: frozenset[int] | None = None
    """The partitions of `problems` this actor holds now (`set_owned`)."""
    _dlq_by: dict[int, int] = field(default_factory=dict)
    _dlq_own_by: dict[int, int] = field(default_factory=dict)
    _committed: dict[int, int] = field(default_factory=dict)
    _low: dict[int, int] = field(default_factory=dict)
    _dlq_seen: int = 0
    _dlq_own: int = 0
    _open: dict[Key, _Open] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def for_config(
        cls, mode: str, max_lag: int, samples_per_step: int, group_size: int, straggler_guard: bool = True
    ) -> Admission:
        return cls(
            group_size=group_size,
            bound=admission_bound(mode, max_lag, samples_per_step, group_size),
            straggler_guard=straggler_guard,
        )

    # -- inputs ----------------------------------------------------------------------------------
    def observe(self, wv: WeightVersion | None) -> None:
        """The latest weight version (None: none published yet)."""
        if wv is None:
            return
        with self._lock:
            if self.version is None or wv.version >= self.version:
                self.version = wv.version
                self.resolved = max(wv.samples_consumed, self.resolved or 0)
                self.by_partition = dict(wv.consumed_by_partition) if wv.attributed else None

    def update_view(self, view: GroupView) -> None:
        with self._lock:
            for p, offset in view.committed.items():
                self._committed[p] = max(self._committed.get(p, -1), offset)
            self._low.update(view.low)
            self._dlq_seen = view.dlq
            self._dlq_own = 0
            if view.dlq_by_partition is not None:
                self._dlq_by = dict(view.dlq_by_partition)
                self._dlq_own_by = {}
            self.members = max(view.members, 1)
            self._drop_committed()

    def on_commit(self, offsets: dict[int, int]) -> None:
        """This actor committed `offsets` (partition -> next offset)."""
        with self._lock:
            for p, offset in offsets.items():
                self._committed[p] = max(self._committed.get(p, -1), offset)
            self._drop_committed()

    def _drop_committed(self) -> None:
        for key in [k for k in self._open if k[1] < self._committed.get(k[0], -1)]:
            del self._open[key]

    def dlq_written(self, partition: int | None = None) -> None:
        """This actor wrote a problem record (of `partition`) to the DLQ."""
        with self._lock:
            self._dlq_own += 1
            if partition is not None:
                self._dlq_own_by[partition] = self._dlq_own_by.get(partition, 0) + 1

    def set_owned(self, partitions: Iterable[int]) -> None:
        """The partitions of `problems` this actor holds now (its share of the bound with several
        actors)."""
        with self._lock:
            self.owned = frozenset(partitions)

    def admit(self, key: Key) -> None:
        with self._lock:
            self._open[key] = _Open(self._resolved_now())

    def generated(self, key: Key) -> None:
        """The group's samples are produced (or it was dead-lettered): no longer a straggler."""
        with self._lock:
            if key in self._open:
                self._open[key].generating = False

    def forget_partitions(self, partitions: Iterable[int]) -> None:
        """Problems of revoked partitions: this actor will not finish them, their next owner counts them."""
        parts = set(partitions)
        with self._lock:
            for key in [k for k in self._open if k[0] in parts]:
                del self._open[key]

    # -- decisions -------------------------------------------------------------------------------
    def _committed_problems(self) -> int:
        total = 0
        for p, offset in self._committed.items():
            low = self._low.get(p, 0)
            total += max(offset, low) - low
        return total

    def admitted_samples(self) -> int:
        """A: samples admitted in the run (an estimate with several actors; with R per partition,
        those of this actor's partitions)."""
        with self._lock:
            return self._admitted()

    def in_flight_samples(self) -> int:
        """A − R: samples admitted and not resolved (this actor's partitions' with R per partition)."""
        with self._lock:
            return self._admitted() - self._resolved_now() if self.resolved is not None else 0

    def _per_partition(self) -> bool:
        """A lineage that counts R per partition, and known partitions: the actor admits on its own
        partitions with their share of the bound (module docstring; with every partition, the
        group-wide rule)."""
        return self.by_partition is not None and self.owned is not None and bool(self._low)

    def _admitted(self) -> int:
        if self._per_partition():
            assert self.owned is not None
            problems = 0
            for p in self.owned:
                low = self._low.get(p, 0)
                committed = max(self._committed.get(p, -1), low) - low
                problems += committed - self._dlq_by.get(p, 0) - self._dlq_own_by.get(p, 0)
            opened = sum(1 for k in self._open if k[0] in self.owned)
            return self.group_size * (problems + opened)
        dlq = self._dlq_seen + self._dlq_own
        return self.group_size * (self._committed_problems() - dlq + self.members * len(self._open))

    def _resolved_now(self) -> int:
        """R: the run's, or (per partition) the samples of this actor's partitions."""
        if self._per_partition():
            assert self.by_partition is not None and self.owned is not None
            return sum(self.by_partition.get(p, 0) for p in self.owned)
        return self.resolved or 0

    def _bound(self) -> int:
        """B, or this actor's share of it: B·owned/P in whole groups (at least one group)."""
        if not self._per_partition():
            return self.bound
        assert self.owned is not None
        if self.owned >= set(self._low):
            return self.bound
        g = self.group_size
        share = self.bound * len(self.owned) // len(self._low)
        return max(share // g * g, g)

    def _base(self) -> int:
        assert self.resolved is not None
        resolved = self._resolved_now()
        if not self.straggler_guard:
            return resolved
        stragglers = [o.resolved_at_admission for o in self._open.values() if o.generating]
        return min([resolved, *stragglers])

    def can_admit(self) -> bool:
        with self._lock:
            if self.resolved is None:
                return False
            return self._admitted() + self.group_size <= self._base() + self._bound()

    def describe(self) -> str:
        with self._lock:
            if self.resolved is None:
                return "waiting for weight version 0"
            mode = (
                f", partitions {sorted(self.owned or ())} of {len(self._low)}"
                if self._per_partition()
                else ""
            )
            return (
                f"version {self.version}, admitted {self._admitted()} samples, resolved {self._resolved_now()}, "
                f"window base {self._base()} + bound {self._bound()}, {len(self._open)} open problems, "
                f"{self.members} actor(s){mode}"
            )
