"""The launcher's progress watchdog: a run that makes no new weight version for
`launcher.stall_timeout_s` while its stages are alive is stuck, and the launcher says where.

Every sample (`observe`) carries the latest version, each stage's output end offset and each
consumer group's lag. When no version came for the timeout, `diagnose` walks the pipeline from
the trainer back and names the first stage that has input waiting but whose output has not moved
since the last version:

- trainer: `training-batches` holds more than two steps' worth of records past the offsets the
  latest version consumed;
- preprocessor, verifier, actor (in that order): its input has lag and its consumed position
  (input end − lag) has not moved for half the timeout (the actor: it, or the servers it waits
  on; an actor held by admission behind a stuck downstream stage is not blamed, since the walk
  finds that stage first);
- nothing waits anywhere and `problems` is consumed: the run is out of problems.

The launcher then stops the run with that message, or, with `launcher.restart`, kills the stuck
stage once so that it is restarted (a stage wedged by a broker restart recovers that way).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PIPELINE = (("preprocessor", "verifier"), ("verifier", "actor"), ("actor", "loader"))
"""(stage, the stage writing its input), downstream first; each stage's lag is its consumer
group's on its input topic."""


@dataclass
class Sample:
    """What the monitor knows at one moment."""

    version: int | None
    outputs: dict[str, int] = field(default_factory=dict)
    """Per producing stage (loader, actor, verifier, preprocessor): end offsets of its output, summed."""
    lags: dict[str, int] = field(default_factory=dict)
    """Per consuming stage: records of its input not yet committed."""
    untrained: int = 0
    """Offsets of training-batches past those the latest version consumed."""
    step_offsets: int = 0
    """Offsets of training-batches one step consumed lately (0: not known yet)."""
    held: dict[tuple[str, int], int] = field(default_factory=dict)
    """Partitions of those outputs whose last stable offset stops short of their log end, with it
    (an open transaction: `stream_rl.kafka.hanging.held_back`)."""


@dataclass
class Stall:
    stage: str | None
    """The stuck stage (None: none found, or out of problems)."""
    message: str


class Watchdog:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._since: float | None = None
        self._at_version: Sample | None = None
        self._latest: Sample | None = None
        self._now = 0.0
        self._position: dict[str, int] = {}
        self._moved_at: dict[str, float] = {}

    def observe(self, now: float, sample: Sample) -> None:
        if self._since is None or self._at_version is None or sample.version != self._at_version.version:
            self._since = now
            self._at_version = sample
        for stage, upstream in PIPELINE:
            position = sample.outputs.get(upstream, 0) - sample.lags.get(stage, 0)
            if self._position.get(stage) != position:
                self._position[stage] = position
                self._moved_at[stage] = now
        self._latest = sample
        self._now = now

    def reset(self, now: float) -> None:
        """Start the clock again (after a stuck stage was restarted)."""
        self._since = now

    def check(self, now: float) -> Stall | None:
        """A `Stall` once no version has come for the timeout, else None."""
        if self._since is None or now - self._since < self.timeout_s:
            return None
        return self.diagnose(now - self._since)

    def diagnose(self, waited_s: float) -> Stall:
        base, cur = self._at_version, self._latest
        assert base is not None and cur is not None
        last = "none yet" if cur.version is None else f"version {cur.version}"
        head = f"no new weight version for {waited_s:.0f}s (last: {last})"
        # The trainer holds a part-filled step and transaction markers take offsets: stuck only
        # with more than two steps' worth waiting.
        if cur.step_offsets and cur.untrained > 2 * cur.step_offsets:
            return Stall(
                "trainer",
                f"{head}; stuck: trainer ({cur.untrained} records of training-batches wait past the "
                "offsets of its last version)",
            )
        for stage, _upstream in PIPELINE:
            lag = cur.lags.get(stage, 0)
            idle = self._now - self._moved_at.get(stage, self._now)
            if lag > 0 and idle >= self.timeout_s / 2:
                what = "actor (or the inference servers it waits on)" if stage == "actor" else stage
                return Stall(
                    stage, f"{head}; stuck: {what} ({lag} input records wait, none consumed for {idle:.0f}s)"
                )
        if all(v == 0 for v in cur.lags.values()) and cur.outputs.get("loader", 0) > 0:
            return Stall(
                None,
                f"{head}; every problem was consumed: the run is out of problems (raise loader.epochs "
                "or lower trainer.max_steps)",
            )
        return Stall(None, f"{head}; no stage is visibly stuck (lags {cur.lags}, outputs {cur.outputs})")
