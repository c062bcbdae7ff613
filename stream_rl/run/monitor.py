"""What the launcher watches while a run goes: the `weight-versions` lineage, the `eval-results`,
broker lag per consumer group and topic end offsets, sampled into `runs/<run>/timeline.jsonl`; a
progress bar; at the end `summary.json` and the plots (`stream_rl/observe/report.py`, `stream_rl/observe/plots.py`).

A resumed run's timeline gets a new `start` record (with `resumed_from`, the lineage's last version
at the start) and only the versions this invocation trains, so its summary describes them alone."""

from __future__ import annotations

import json
import time
from collections import deque
from typing import IO, Any

from tqdm import tqdm

from stream_rl.config import RunConfig
from stream_rl.contracts import EvalResult, WeightVersion
from stream_rl.errors import KafkaError
from stream_rl.kafka.confluent import KafkaTransport
from stream_rl.kafka.follower import RecordFollower, VersionFollower
from stream_rl.kafka.hanging import held_back
from stream_rl.kafka.lag import LagExporter
from stream_rl.kafka.topics import EVAL_RESULTS, PROBLEMS, RAW_ROLLOUTS, SCORED, TRAINING_BATCHES, TopicNames
from stream_rl.run.watchdog import Sample

SAMPLE_EVERY_S = 5.0
"""Lag and offsets sampling period (each sample is a few dozen broker requests)."""
STAGE_TOPICS = {
    "loader": PROBLEMS,
    "actor": RAW_ROLLOUTS,
    "verifier": SCORED,
    "preprocessor": TRAINING_BATCHES,
}


class RunMonitor:
    def __init__(
        self,
        config: RunConfig,
        bootstrap: str,
        progress: bool = True,
        since_version: int | None = None,
        software: dict[str, str | None] | None = None,
    ) -> None:
        """`software`: the versions this invocation runs (`stream_rl.train.record.software`), in
        the timeline's start record and the summary."""
        self.config = config
        self.software = software or {}
        self.run_dir = config.run_dir
        self.kafka = KafkaTransport.for_run(config.kafka, bootstrap)
        self.names = TopicNames(run=config.run, prefix=config.kafka.prefix)
        self.t0 = time.time()
        self._timeline_path = self.run_dir / "timeline.jsonl"
        self._timeline: IO[str] | None = None
        self._follower = VersionFollower(self.kafka, self.names, client_id="launcher", keep_history=True)
        self._evals = RecordFollower(
            self.kafka, self.names[EVAL_RESULTS], EvalResult, "launcher-evals", keep_history=True
        )
        self.since_version = since_version
        self.last_eval: EvalResult | None = None
        """The latest evaluation of this invocation's versions (the timeline has them all)."""
        self._lag = LagExporter(self.kafka, self.names)  # also served on the launcher's /metrics
        self._last_version: WeightVersion | None = None
        self.recent: deque[WeightVersion] = deque(maxlen=64)
        """The latest versions this invocation trained (`stream_rl.run.autoscale` reads them)."""
        self._step_offsets = 0
        self.sample: Sample | None = None
        """The latest progress sample (for the launcher's watchdog)."""
        self._last_sample = 0.0
        self._bar: tqdm[Any] | None = None
        self._progress = progress

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._timeline = open(self._timeline_path, "a")  # noqa: SIM115 - lives until finish()
        self._write(
            {
                "kind": "start",
                "wall_time": self.t0,
                "config": self.config.run,
                "resumed_from": self.since_version,
                "software": self.software,
            }
        )
        self._follower.start()
        self._evals.start()
        if self._progress:
            self._bar = tqdm(
                total=self.config.trainer.max_steps,
                unit="step",
                dynamic_ncols=True,
                desc=self.config.run,
                smoothing=0.1,
            )

    @property
    def latest(self) -> WeightVersion | None:
        return self._follower.latest

    def _write(self, record: dict[str, Any]) -> None:
        if self._timeline is None:
            return
        record = {"t": round(time.time() - self.t0, 3), **record}
        self._timeline.write(json.dumps(record) + "\n")
        self._timeline.flush()

    def record(self, record: dict[str, Any]) -> None:
        """Append a record to the timeline (`t` added), e.g. the autoscaler's decisions."""
        self._write(record)

    def tick(self) -> None:
        """Record new versions, sample lag/offsets every few seconds, refresh the bar."""
        new = self._follower.drain()
        for wv in new:
            if self.since_version is not None and wv.version <= self.since_version:
                continue  # trained by an earlier invocation
            self.recent.append(wv)
            # The step's metrics first: the lineage fields (cumulative counters) win on a name clash.
            self._write(
                {
                    **wv.metrics,
                    "kind": "version",
                    "version": wv.version,
                    "step": wv.step,
                    "vkind": wv.kind.value,
                    "samples_trained": wv.samples_trained,
                    "samples_filtered": wv.samples_filtered,
                    "tokens_trained": wv.tokens_trained,
                    "broadcast_ms": wv.broadcast_ms,
                    "servers_failed": len(wv.servers_failed),
                    "created_ms": wv.created_ms,
                }
            )
            if self._bar is not None and wv.step > self._bar.n:
                self._bar.update(wv.step - self._bar.n)
        for wv in new:
            consumed = self._consumed(wv)
            if self._last_version is not None and wv.version == self._last_version.version + 1:
                self._step_offsets = max(consumed - self._consumed(self._last_version), 0)
            self._last_version = wv
        for ev in self._evals.drain():
            if self.since_version is not None and ev.version <= self.since_version:
                continue
            self.last_eval = ev
            self._write({"kind": "eval", **ev.to_dict()})
        now = time.time()
        if now - self._last_sample >= SAMPLE_EVERY_S:
            self._last_sample = now
            self._sample()
        if self._bar is not None and self._last_version is not None:
            last = self._last_version
            elapsed = max(now - self.t0, 1e-9)
            postfix = {
                "reward": f"{last.metrics.get('reward_mean', float('nan')):.3f}",
                "lag": f"{last.metrics.get('version_lag_mean', float('nan')):.2f}",
                "samples_s": f"{last.samples_trained / elapsed:.1f}",
            }
            shown = self.last_eval
            if shown is not None:
                named = [
                    f"{label} {value:.2f}"
                    for label, value in (("sampled", shown.sampled_pass_at_1), ("greedy", shown.pass_at_1))
                    if value is not None
                ]
                if named:
                    postfix["eval pass@1"] = f"{' '.join(named)} @v{shown.version}"
            self._bar.set_postfix(postfix, refresh=False)

    def _sample(self) -> None:
        try:
            offsets = {}
            held: dict[tuple[str, int], int] = {}
            for stage, topic in STAGE_TOPICS.items():
                name = self.names[topic]
                marks = self.kafka.watermarks(name)
                offsets[stage] = sum(h for _, h in marks.values())
                held.update(held_back(name, marks, self.kafka.log_ends(name)))
            lags: dict[str, int] = {}
            for x in self._lag.refresh(with_age=False):
                role = x.group.rsplit(".", 1)[-1]
                lags[role] = lags.get(role, 0) + x.lag
        except KafkaError:
            return  # a transient admin failure costs one sample, not the run
        latest = self._follower.latest
        self.sample = Sample(
            version=latest.version if latest else None,
            outputs=offsets,
            lags=lags,
            untrained=max(offsets.get("preprocessor", 0) - self._consumed(latest), 0) if latest else 0,
            step_offsets=self._step_offsets,
            held=held,
        )
        self._write({"kind": "offsets", "offsets": offsets})
        self._write({"kind": "lag", "lag": lags})

    def _consumed(self, wv: WeightVersion | None) -> int:
        """Offsets of training-batches a version had consumed."""
        topic = self.names[TRAINING_BATCHES]
        return sum(o.offset for o in (wv.consumed_offsets if wv else []) if o.topic == topic)

    def has_eval(self, version: int) -> bool:
        """Whether the eval-results of `version` has been seen (among the follower's last records:
        asked for the final version, whose evaluation is the last one published)."""
        return any(ev.version == version for ev in self._evals.records)

    def close(self) -> None:
        self.tick()
        self._follower.stop()
        self._evals.stop()
        if self._bar is not None:
            self._bar.close()

    def finish(self, wall_s: float, exit_reason: str, failed: str | None) -> dict[str, Any]:
        from stream_rl.observe.report import load_timeline, summarize, write_plots

        if self._timeline is not None:
            self._timeline.close()
            self._timeline = None
        summary = summarize(
            load_timeline(self._timeline_path),
            self.config,
            wall_s=wall_s,
            exit_reason=exit_reason,
            failed=failed,
        )
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        write_plots(load_timeline(self._timeline_path), self.run_dir / "plots")
        return summary
