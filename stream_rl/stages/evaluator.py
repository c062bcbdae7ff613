"""The evaluator: held-out evaluation of the weight versions as training goes.

Follows `weight-versions` (no consumer group). Produces `eval-results` (key = run_id): one
`EvalResult` per evaluated version. Enabled by `eval.every > 0`; the launcher starts it.

For each due version V (0, `every`, 2·`every`, ... and the final one) it samples the task's
held-out split (`Task.load_eval_problems`, disjoint from training; the first `eval.max_problems`)
on the inference servers, greedily (pass@1) and/or `eval.samples` times at `eval.temperature`
(sampled pass@1, pass@k), scores each completion with the task's verifier (`Task.score`, or the
environment's verdict of a multi-turn rollout) and publishes the result.

Which weights are evaluated. The servers are shared with the actors and their weights move in
flight, so the stage pins what it can and measures the rest:
- it evaluates V only on servers whose `version()` (each engine's client) is V when it starts (a version the servers
  have already left, e.g. after a resume, is skipped and logged, never mislabelled);
- every request of V is sent at once, as soon as V is published (the trainer publishes V after
  pushing it), so an evaluation normally finishes before the next push;
- tokens decoded after a push mid-evaluation carry the new version in their version spans (exact:
  the engine records the version of every token), so `off_version_tokens` /
  `off_version_token_frac` say how much of the result is not V's. The launcher evaluates
  version 0 before it starts the actors (nothing else is generating, nothing can move) and the
  final version is never followed by another push: both are exact.
When it falls behind by more than `every` versions it skips the older due version (logged).

Sampling seeds are derived from the run seed, the version and the problem id, so an evaluation
is reproducible. The stage exits (status 0) once the final version is evaluated.

Inference calls (each server's engine client, `stream_rl.inference.clients.make_client`):
`complete_many(messages, sampling, n=..., seed=...)` and `version()` for
single-turn tasks (chat messages; the server applies the template) and
`stream_rl.stages.rollouts.TurnClient` (which calls `complete`) for multi-turn tasks.

Run alone: `stream-rl evaluator --config run.yaml [--idle-timeout S] [--max-records N]`
(`--max-records`: evaluations to publish before stopping).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
from typing import Any

from stream_rl.common import heap
from stream_rl.common.metrics import RECORDS_OUT
from stream_rl.config import RunConfig
from stream_rl.contracts import EvalResult, Problem, WeightVersion, WeightVersionKind, now_ms
from stream_rl.errors import ConfigError, InferenceError, StreamRLError
from stream_rl.kafka.follower import VersionFollower
from stream_rl.kafka.reader import read_to_end
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.stage import StageStats, StopFlag
from stream_rl.kafka.topics import EVAL_RESULTS, TopicNames
from stream_rl.kafka.transport import Transport
from stream_rl.stages.entry import Instance, add_stage_arguments, open_transport, run_stage_command
from stream_rl.stages.evaluation import Outcome, aggregate, count_versions, is_due
from stream_rl.stages.rollouts import ChatTokenizer, TurnClient, sample_seed
from stream_rl.stages.routing import ClientFactory, inference_client_factory, server_urls
from stream_rl.tasks import get_task

log = logging.getLogger(__name__)

CONSUMES = None
PRODUCES = (EVAL_RESULTS,)


def eval_problems(config: RunConfig) -> list[Problem]:
    """The held-out problems the evaluator samples (the first `eval.max_problems` of the split)."""
    task = get_task(config.task.name, config.task.params, config.task.system_prompt)
    problems = task.load_eval_problems(config.run, config.seed)
    return problems[: config.eval.max_problems] if config.eval.max_problems else problems


class Evaluator:
    def __init__(
        self,
        config: RunConfig,
        transport: Transport,
        stop: StopFlag,
        instance: Instance = 0,
        client_factory: ClientFactory | None = None,
        tokenizer: Any = None,
    ) -> None:
        if config.eval.every <= 0:
            raise ConfigError("eval.every: the evaluator needs eval.every > 0 (versions between evaluations)")
        self.config = config
        self.cfg = config.eval
        self.transport = transport
        self.stop = stop
        self.names = TopicNames(config.run, config.kafka.prefix)
        self.topic = self.names[EVAL_RESULTS]
        self.evaluator_id = f"evaluator-{instance}"
        self.serde = default_serde()
        self.task = get_task(config.task.name, config.task.params, config.task.system_prompt)
        self.problems = eval_problems(config)
        if tokenizer is None and self.task.multi_turn:
            tokenizer = ChatTokenizer(config.model.path)
        self.tokenizer = tokenizer
        self.client_factory = client_factory or inference_client_factory(config)
        self.stats = StageStats()
        self.done: set[int] = set()

    # -- which version ---------------------------------------------------------------------------
    def _next(self, history: list[WeightVersion], start: int) -> WeightVersion | None:
        """The due version to evaluate now: the newest due one not done, seen from `start` on
        (older due ones it leaves behind are skipped)."""
        due = [
            wv
            for wv in history[start:]
            if wv.version not in self.done
            and is_due(wv.version, self.cfg.every, wv.kind == WeightVersionKind.FINAL)
        ]
        if not due:
            return None
        newest = max(due, key=lambda wv: wv.version)
        for wv in due:
            if wv.version < newest.version:
                log.warning(
                    "%s: version %d skipped: version %d is already due",
                    self.evaluator_id,
                    wv.version,
                    newest.version,
                )
                self.done.add(wv.version)
                self.stats.extra["skipped"] = self.stats.extra.get("skipped", 0) + 1
        return newest

    async def _holding(self, clients: dict[str, Any], version: int) -> list[Any]:
        """The clients of the servers whose weights are `version` now."""
        out = []
        for url, client in clients.items():
            try:
                held = await client.version()
            except InferenceError as exc:
                log.warning("%s: server %s unavailable: %s", self.evaluator_id, url, exc)
                continue
            if held == version:
                out.append(client)
        return out

    # -- one evaluation --------------------------------------------------------------------------
    async def _sample(self, client: Any, problem: Problem, version: int, greedy: bool) -> list[Outcome]:
        cfg = self.cfg
        sampling = cfg.sampling(self.config.actor.sampling, greedy)
        seed = sample_seed(self.config.seed, f"eval:{version}:{problem.problem_id}")
        if self.task.multi_turn:
            out = []
            for i in range(1 if greedy else cfg.samples):
                result = await self.task.generate_rollout(
                    TurnClient(client, self.tokenizer, seed + i), problem, sampling
                )
                n, off, lo, hi = count_versions(
                    result.version_spans, len(result.completion_token_ids), version, result.completion_mask
                )
                s = result.scored
                out.append(Outcome(problem.problem_id, greedy, s.verdict, s.reward, n, off, lo, hi))
            return out
        messages = [m.to_dict() for m in problem.prompt]
        completions = await client.complete_many(
            messages, sampling, n=1 if greedy else cfg.samples, seed=seed
        )
        out = []
        for c in completions:
            scored = await asyncio.to_thread(self.task.score, problem, c.text, finish_reason=c.finish_reason)
            n, off, lo, hi = count_versions(c.version_spans, len(c.token_ids), version)
            out.append(Outcome(problem.problem_id, greedy, scored.verdict, scored.reward, n, off, lo, hi))
        return out

    async def _with_retries(self, clients: list[Any], index: int, *args: Any) -> list[Outcome]:
        retries = self.config.actor.max_retries
        for attempt in range(retries + 1):
            client = clients[(index + attempt) % len(clients)]
            try:
                return await self._sample(client, *args)
            except InferenceError as exc:
                if attempt == retries:
                    raise
                log.info("%s: eval request failed (%s); retrying", self.evaluator_id, exc)
                await asyncio.sleep(min(self.config.actor.backoff_s * 2**attempt, 5.0))
        raise AssertionError("unreachable")

    async def evaluate(self, clients: list[Any], version: int) -> EvalResult:
        """Sample and score the held-out split on `clients` (servers holding `version`)."""
        started = now_ms()
        gate = asyncio.Semaphore(self.cfg.concurrency)
        modes = ([True] if self.cfg.greedy else []) + ([False] if self.cfg.samples else [])

        async def one(index: int, problem: Problem, greedy: bool) -> list[Outcome]:
            async with gate:
                return await self._with_retries(clients, index, problem, version, greedy)

        jobs = [one(i, p, g) for i, p in enumerate(self.problems) for g in modes]
        outcomes = [o for batch in await asyncio.gather(*jobs) for o in batch]
        return aggregate(
            outcomes,
            run_id=self.config.run,
            version=version,
            task=self.task.name,
            split=self.task.eval_split,
            num_problems=len(self.problems),
            k=self.cfg.samples,
            temperature=self.cfg.temperature,
            evaluator_id=self.evaluator_id,
            started_ms=started,
        )

    # -- the loop --------------------------------------------------------------------------------
    def _read_done(self) -> None:
        for msg in read_to_end(self.transport, self.topic, client_id=f"{self.evaluator_id}-done"):
            self.done.add(self.serde.decode(msg.value, EvalResult).version)

    async def run(self, max_records: int | None = None, idle_timeout_s: float | None = None) -> StageStats:
        self._read_done()
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def woken(_wv: WeightVersion) -> None:
            loop.call_soon_threadsafe(wake.set)

        follower = VersionFollower(
            self.transport,
            self.names,
            client_id=f"{self.evaluator_id}-versions",
            keep_history=True,
            on_version=woken,
        ).start()
        clients = {url: self.client_factory(url) for url in server_urls(self.config)}
        producer = self.transport.producer(self.evaluator_id)
        heap.settle()
        last_input = time.monotonic()
        history: list[WeightVersion] = []
        final_seen = False
        try:
            while True:
                if self.stop:
                    self.stats.stopped_by = self.stop.reason or "stopped"
                    break
                if max_records is not None and self.stats.records_out >= max_records:
                    self.stats.stopped_by = "max_records"
                    break
                for seen in follower.drain():  # keep only the versions still due
                    final_seen = final_seen or seen.kind == WeightVersionKind.FINAL
                    if seen.version not in self.done and is_due(
                        seen.version, self.cfg.every, seen.kind == WeightVersionKind.FINAL
                    ):
                        history.append(seen)
                wv = self._next(history, 0)
                history = [v for v in history if v.version not in self.done and (wv is None or v is not wv)]
                if wv is None:
                    if final_seen:
                        self.stats.stopped_by = "final version evaluated"
                        break
                    if idle_timeout_s is not None and time.monotonic() - last_input >= idle_timeout_s:
                        self.stats.stopped_by = "idle_timeout"
                        break
                    wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(wake.wait(), timeout=0.2)
                    continue
                last_input = time.monotonic()
                self.done.add(wv.version)
                self.stats.records_in += 1
                holding = await self._holding(clients, wv.version)
                if not holding:
                    log.warning(
                        "%s: no server holds version %d now: not evaluated", self.evaluator_id, wv.version
                    )
                    self.stats.extra["skipped"] = self.stats.extra.get("skipped", 0) + 1
                    continue
                try:
                    result = await self.evaluate(holding, wv.version)
                except StreamRLError as exc:
                    log.error("%s: evaluation of version %d failed: %s", self.evaluator_id, wv.version, exc)
                    # Nothing goes to a DLQ (the input is a version, not a bad record): counted as failed.
                    self.stats.extra["failed"] = self.stats.extra.get("failed", 0) + 1
                    continue
                producer.produce(self.topic, self.serde.encode(result), key=self.config.run)
                await asyncio.to_thread(producer.flush)
                RECORDS_OUT.labels("evaluator", self.topic).inc()
                self.stats.records_out += 1
                log.info(
                    "%s: version %d: pass@1 %s, pass@%d %s, off-version tokens %.3f (%.1fs)",
                    self.evaluator_id,
                    result.version,
                    "-" if result.pass_at_1 is None else f"{result.pass_at_1:.3f}",
                    result.k,
                    "-" if result.pass_at_k is None else f"{result.pass_at_k:.3f}",
                    result.off_version_token_frac,
                    (result.finished_ms - result.started_ms) / 1000,
                )
        finally:
            follower.stop()
            for client in clients.values():
                await client.aclose()
            producer.close()
        return self.stats


def run(
    config: RunConfig,
    *,
    transport: Transport | None = None,
    stop: StopFlag | None = None,
    max_records: int | None = None,
    idle_timeout_s: float | None = None,
    instance: Instance = 0,
    client_factory: ClientFactory | None = None,
    tokenizer: Any = None,
) -> StageStats:
    """Run the evaluator until the final version is evaluated, `stop`, `max_records` evaluations
    or `idle_timeout_s` without a new version."""
    evaluator = Evaluator(
        config,
        open_transport(config, transport),
        stop if stop is not None else StopFlag(),
        instance,
        client_factory,
        tokenizer,
    )
    return asyncio.run(evaluator.run(max_records, idle_timeout_s))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_stage_arguments(parser)


def main(args: argparse.Namespace) -> int:
    return run_stage_command("evaluator", run, args)
