"""The actor: turns problems into rollouts by sampling the inference servers.

Consumes `problems` (consumer group `actor`). Produces `raw-rollouts`: for each problem,
`actor.group_size` records (key = group_id, one per sample: token ids, behaviour logprobs,
version spans, text); problems that cannot be sampled go to `problems.dlq` with the reason.

How it works: one asyncio loop. The consumer is polled (in a worker thread); problems wait in
`ProblemOrder` (a few per partition, full partitions paused), which hands them out in the
loader's plan order across partitions, so epochs are epochs (`stream_rl.stages.problem_order`). A problem is admitted when `Admission.can_admit()` says
so (`stream_rl.stages.admission`: the staleness bound and its proof, conventional mode,
several actors); then its group_size samples are requested concurrently, each routed by
`ServerPool` (least loaded, a cap per server, retries with backoff, dead servers probed back;
a multi-turn rollout stays on one server). Single-turn problems are sent as chat messages
(the server renders them); multi-turn tasks drive `TurnClient`s with the model's tokenizer.

Invariants:
- A group's records are produced together, once all its samples exist: downstream never sees
  part of a group unless the actor died while producing it (the restart completes it, with the
  same ids).
- At least once: a problem's offset is committed only after its records (or its DLQ record)
  are flushed, in order per partition (`OffsetTracker`). A restart re-generates uncommitted
  problems; rollout ids are deterministic (`<problem_id>.e<epoch>.s<i>`) and the preprocessor
  drops the duplicates. With `actor.seeded_sampling` the re-generated samples even match.
- No problem is dropped because servers are down: calls wait for a server to come back.
- Servers that join the run (`servers` topic, `stream_rl.kafka.servers_topic`) are routed to once they
  hold the newest version; a draining one gets no new request (`ServerPool.add` / `drain`).
- SIGTERM drains: no new admissions, in-flight groups finish (bounded by the request timeout),
  outputs are flushed and offsets committed.

Run alone: `stream-rl actor --config run.yaml [--instance i]` (inference servers from
`inference.servers` or `inference.num_servers`/`base_port`; the trainer must have published
weight version 0 before anything is admitted).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import time
from collections import deque

from prometheus_client import Counter, Gauge

from stream_rl.common import heap
from stream_rl.common.metrics import DUPLICATES, RECORDS_IN, RECORDS_OUT
from stream_rl.common.windows import RecentKeys
from stream_rl.config import RunConfig
from stream_rl.contracts import Problem, Rollout, ServerMembership
from stream_rl.errors import ContractError, KafkaError
from stream_rl.kafka.dead_letters import DeadLetters
from stream_rl.kafka.follower import VersionFollower
from stream_rl.kafka.offsets import OffsetTracker
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.servers_topic import follow_members, read_members
from stream_rl.kafka.stage import StageStats, StopFlag
from stream_rl.kafka.topics import PROBLEMS, RAW_ROLLOUTS, TopicNames
from stream_rl.kafka.transport import Message, TopicPartition, Transport
from stream_rl.stages.admission import Admission, Key, ViewRefresh
from stream_rl.stages.entry import Instance, add_stage_arguments, open_transport, run_stage_command
from stream_rl.stages.problem_order import PartitionFlow, ProblemOrder
from stream_rl.stages.rollouts import ChatTokenizer, Sampler, Tokenizer, sample_seed
from stream_rl.stages.routing import (
    ClientFactory,
    RequestRejected,
    Server,
    ServerPool,
    inference_client_factory,
    server_urls,
)
from stream_rl.tasks import get_task

log = logging.getLogger(__name__)

CONSUMES = PROBLEMS
PRODUCES = (RAW_ROLLOUTS,)

ADMITTED = Counter("stream_rl_actor_admitted_problems", "Problems admitted", ["actor"])
IN_FLIGHT = Gauge("stream_rl_actor_in_flight_samples", "Samples admitted and not resolved", ["actor"])
SERVER_LIVE = Gauge("stream_rl_actor_server_live", "1 while a server is in routing", ["actor", "server"])

POLL_BATCH = 16
SEEN_WINDOW = 20_000
OFFSET_BITS = 40  # where a problem was taken: partition << 40 | offset, in one int64
COMMIT_EVERY_S = 0.5  # each commit is a broker write: a crash redoes at most this much


class Actor:
    def __init__(
        self,
        config: RunConfig,
        transport: Transport,
        stop: StopFlag,
        instance: Instance = 0,
        client_factory: ClientFactory | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.config = config
        self.cfg = config.actor
        self.transport = transport
        self.stop = stop
        self.names = TopicNames(config.run, config.kafka.prefix)
        self.topic = self.names[PROBLEMS]
        self.out_topic = self.names[RAW_ROLLOUTS]
        self.dlq_topic = self.names.dlq(PROBLEMS)
        self.dead_letters = DeadLetters("actor", self.dlq_topic)
        self.group = self.names.group("actor")
        self.actor_id = f"actor-{instance}"
        self.instance_id = f"{config.kafka.prefix}.{config.run}.actor.{instance}"
        self.serde = default_serde()
        self.task = get_task(config.task.name, config.task.params, config.task.system_prompt)
        if tokenizer is None and self.task.multi_turn:
            tokenizer = ChatTokenizer(config.model.path)
        self.tokenizer = tokenizer
        self.sampler = Sampler(self.task, tokenizer, self.cfg.sampling, self.actor_id)
        self.admission = Admission.for_config(
            config.mode,
            self.cfg.max_lag,
            config.trainer.samples_per_step,
            self.cfg.group_size,
            straggler_guard=self.cfg.straggler_guard,
        )
        self.client_factory = client_factory
        self.tracker = OffsetTracker()
        self.stats = StageStats()
        self._buffer = ProblemOrder(POLL_BATCH // 2)
        self._flow = PartitionFlow(self.topic)
        self._seen = RecentKeys(SEEN_WINDOW)
        """(problem_id, epoch) -> where it was taken, of the last SEEN_WINDOW problems (fixed memory)."""
        self._tasks: dict[Key, asyncio.Task[None]] = {}
        self._done: list[Message] = []
        self._revoked: deque[list[TopicPartition]] = deque()
        self._failure: BaseException | None = None
        self._last_commit = 0.0
        self.views = ViewRefresh(
            transport, self.topic, self.dlq_topic, self.group, config.launcher.actors, self.cfg.refresh_s
        )
        self._last_state_log = 0.0

    # -- Kafka side --------------------------------------------------------------------------
    async def _refresh(self, force: bool = False) -> None:
        if not self.views.due(force):
            return
        try:
            view = await asyncio.to_thread(self.views.read)
        except KafkaError as exc:  # the broker is away: keep the last view (it only moves forward)
            if force:
                raise
            log.warning("%s: admission view not refreshed: %s", self.actor_id, exc)
            return
        self.admission.update_view(view)

    def _on_assign(self, partitions: list[TopicPartition]) -> None:
        log.info("%s: partitions %s assigned", self.actor_id, sorted(p for _t, p in partitions))
        self.views.assigned = True  # their previous owner's last commits: read them now
        self._flow.assigned(partitions)

    def _on_revoke(self, partitions: list[TopicPartition]) -> None:
        """Poll thread: commit what is durable, hand the rest to the loop to cancel."""
        offsets = self.tracker.committable()
        if offsets:
            try:
                self.consumer.commit(offsets)
                self.admission.on_commit({p: o for (_t, p), o in offsets.items()})
            except KafkaError as exc:  # partitions lost, not revoked: their next owner redoes them
                log.warning("%s: commit on revocation failed: %s", self.actor_id, exc)
        self.tracker.forget(partitions)
        self._revoked.append(list(partitions))

    def _apply_revocations(self) -> None:
        while self._revoked:
            parts = {p for _t, p in self._revoked.popleft()}
            self._buffer.drop(parts)
            self._flow.revoked(parts)
            for key in [k for k in self._tasks if k[0] in parts]:
                self._tasks[key].cancel()
            self._done = [m for m in self._done if m.partition not in parts]
            self.admission.forget_partitions(parts)
            log.info(
                "%s: partitions %s revoked; their unfinished problems go to the next owner",
                self.actor_id,
                sorted(parts),
            )

    def _dead_letter(self, msg: Message, error: str) -> None:
        self.dead_letters.write(self.producer, msg, error)
        self.admission.dlq_written(msg.partition)
        self.stats.dlq += 1

    def _accept(self, msgs: list[Message]) -> None:
        for msg in msgs:
            self.tracker.started(msg)
            self.stats.records_in += 1
            RECORDS_IN.labels("actor", msg.topic).inc()
            try:
                problem = self.serde.decode(msg.value, Problem)
            except ContractError as exc:
                self._dead_letter(msg, str(exc))
                self._done.append(msg)
                continue
            if problem.task != self.task.name:
                self._dead_letter(
                    msg, f"problem of task {problem.task!r}; this run's task is {self.task.name!r}"
                )
                self._done.append(msg)
                continue
            seen_key = f"{len(problem.problem_id)}:{problem.problem_id}:{problem.epoch}"
            where = msg.partition << OFFSET_BITS | msg.offset
            first = self._seen.get(seen_key)
            if first is not None and first != where:  # not a re-delivery of the same record
                DUPLICATES.labels("actor").inc()
                self.stats.extra["duplicates"] = self.stats.extra.get("duplicates", 0.0) + 1
                self._dead_letter(
                    msg,
                    f"duplicate of (problem {problem.problem_id}, epoch {problem.epoch}) at "
                    f"{msg.topic}[{first >> OFFSET_BITS}]@{first & ((1 << OFFSET_BITS) - 1)}",
                )
                self._done.append(msg)
                continue
            self._seen.put(seen_key, where)
            self._buffer.add(msg, problem)

    async def _commit(self, force: bool = False) -> None:
        if not self._done or (not force and time.monotonic() - self._last_commit < COMMIT_EVERY_S):
            return
        batch, self._done = self._done, []
        await asyncio.to_thread(self.producer.flush)
        for msg in batch:
            if self.tracker.tracks(msg):
                self.tracker.done(msg)
        offsets = self.tracker.committable()
        if offsets:
            await asyncio.to_thread(self.consumer.commit, offsets)
            self.admission.on_commit({p: o for (_t, p), o in offsets.items()})
        self._last_commit = time.monotonic()
        self.stats.batches += 1

    # -- generation --------------------------------------------------------------------------
    def _exhausted(self, partition: int) -> bool:
        """Nothing more to read in `partition` for now (its head cannot be waited for)."""
        tp = (self.topic, partition)
        end = self.consumer.end_offset(tp)
        return end >= 0 and self.consumer.position().get(tp, 0) >= end

    def _admit(self, wait: bool = True) -> bool:
        admitted = False
        assigned = [p for t, p in self.consumer.assignment() if t == self.topic]
        self.admission.set_owned(assigned)
        while self._buffer and self.admission.can_admit():
            item = self._buffer.pop(assigned, self._exhausted, wait)
            if item is None:
                break
            msg, problem = item
            key = (msg.partition, msg.offset)
            self.admission.admit(key)
            ADMITTED.labels(self.actor_id).inc()
            task = asyncio.create_task(self._group(msg, problem, key))
            self._tasks[key] = task
            task.add_done_callback(functools.partial(self._task_done, key))
            admitted = True
        return admitted

    def _task_done(self, key: Key, task: asyncio.Task[None]) -> None:
        if self._tasks.get(key) is task:
            del self._tasks[key]
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            self._failure = task.exception()
        self._wake.set()

    async def _group(self, msg: Message, problem: Problem, key: Key) -> None:
        samples: list[asyncio.Task[Rollout | list[Rollout]]]
        if self.task.multi_turn:  # one conversation per sample, each on one server
            samples = [asyncio.create_task(self._sample(problem, i)) for i in range(self.cfg.group_size)]
        else:  # the whole group in one request (n = group_size)
            samples = [asyncio.create_task(self._sample_group(problem))]
        try:
            results = await asyncio.gather(*samples)
            rollouts = [r for res in results for r in (res if isinstance(res, list) else [res])]
        except RequestRejected as exc:
            for s in samples:
                s.cancel()
            await asyncio.gather(*samples, return_exceptions=True)
            self._dead_letter(msg, str(exc))
        except BaseException:
            for s in samples:
                s.cancel()
            raise
        else:
            # All at once, no await in between: a cancellation never splits a group.
            for rollout in rollouts:
                rollout.problem_partition = msg.partition
                self.producer.produce(self.out_topic, self.serde.encode(rollout), key=rollout.group_id)
            self.stats.records_out += len(rollouts)
            RECORDS_OUT.labels("actor", self.out_topic).inc(len(rollouts))
        self.admission.generated(key)
        self._done.append(msg)
        self._wake.set()

    async def _sample_group(self, problem: Problem) -> Rollout | list[Rollout]:
        group_id = Rollout.make_group_id(problem)
        seed = sample_seed(self.config.seed, group_id) if self.cfg.seeded_sampling else None

        async def call(server: Server) -> list[Rollout]:
            rollouts = await self.sampler.sample_group(
                server.client, server.url, problem, self.cfg.group_size, seed
            )
            self._check_fresh(server, rollouts)
            return rollouts

        return await self.pool.call(call, group_id)

    async def _sample(self, problem: Problem, index: int) -> Rollout | list[Rollout]:
        rollout_id = Rollout.make_rollout_id(Rollout.make_group_id(problem), index)
        seed = sample_seed(self.config.seed, rollout_id) if self.cfg.seeded_sampling else None

        async def call(server: Server) -> Rollout:
            rollout = await self.sampler.sample_conversation(
                server.client, server.url, problem, index, self.cfg.group_size, seed
            )
            self._check_fresh(server, [rollout])
            return rollout

        return await self.pool.call(call, rollout_id)

    def _check_fresh(self, server: Server, rollouts: list[Rollout]) -> None:
        versions = [span.version for r in rollouts for span in r.version_spans]
        if versions:
            self.pool.check_fresh(server, min(versions))

    def _apply_members(self, records: list[ServerMembership]) -> None:
        """Servers that joined or are leaving the run (module docstring)."""
        for m in records:
            self._engines.setdefault(m.url, m.engine)
        for url in self.pool.apply_members(records, self._factory):
            SERVER_LIVE.labels(self.actor_id, url).set(0)

    def _observe_version(self) -> None:
        latest = self.follower.latest
        if latest is not None:
            self.pool.observe(latest.version, latest.servers_updated, latest.servers_failed)

    # -- the loop ----------------------------------------------------------------------------
    def _wake_from_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.call_soon_threadsafe(self._wake.set)

    def _check_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _publish_gauges(self) -> None:
        IN_FLIGHT.labels(self.actor_id).set(self.admission.in_flight_samples())
        for s in self.pool.servers:
            SERVER_LIVE.labels(self.actor_id, s.url).set(0 if s.dead or s.draining else 1)
        now = time.monotonic()
        if self._buffer and now - self._last_state_log > 10:
            self._last_state_log = now
            log.info(
                "%s: holding %d problems: %s", self.actor_id, len(self._buffer), self.admission.describe()
            )

    async def _loop(self, max_records: int | None, idle_timeout_s: float | None) -> None:
        last_input = time.monotonic()
        while True:
            self._check_failure()
            if self.stop:
                self.stats.stopped_by = self.stop.reason or "stopped"
                return
            exhausted = max_records is not None and self.stats.records_in >= max_records
            if exhausted and not self._buffer:
                self.stats.stopped_by = "max_records"
                return
            await self._refresh()
            self.admission.observe(self.follower.latest)
            self._apply_members(self.members.drain())
            self._observe_version()
            progressed = False
            # Polling also serves rebalances, so it goes on while problems wait for admission; full
            # partitions are paused, so it fetches the partitions whose head is missing.
            self._flow.apply(self.consumer, self._buffer)  # full partitions paused
            if not exhausted:
                want = (
                    POLL_BATCH
                    if max_records is None
                    else min(POLL_BATCH, max_records - self.stats.records_in)
                )
                msgs = await asyncio.to_thread(self.consumer.poll_batch, want, 0.1)
                self._apply_revocations()
                if msgs:
                    self._accept(msgs)
                    progressed = True
            progressed = self._admit(wait=not exhausted) or progressed
            await self._commit()
            self._publish_gauges()
            now = time.monotonic()
            if progressed or self._tasks or self._buffer:
                last_input = now
            elif idle_timeout_s is not None and now - last_input >= idle_timeout_s and not self._done:
                self.stats.stopped_by = "idle_timeout"
                return
            if exhausted and self._buffer and not progressed:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=0.1)

    async def _drain(self) -> None:
        if self._tasks:
            log.info("%s: draining %d groups in flight", self.actor_id, len(self._tasks))
            _done, pending = await asyncio.wait(
                list(self._tasks.values()), timeout=self.cfg.request_timeout_s
            )
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        self._check_failure()
        await self._commit(force=True)

    async def run(self, max_records: int | None = None, idle_timeout_s: float | None = None) -> StageStats:
        loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        urls = server_urls(self.config)
        self._engines: dict[str, str] = {}
        self._factory = factory = self.client_factory or inference_client_factory(self.config, self._engines)
        self.pool = ServerPool(
            {url: factory(url) for url in urls},
            cap=self.cfg.concurrency_per_server,
            max_retries=self.cfg.max_retries,
            backoff_s=self.cfg.backoff_s,
            backoff_max_s=self.cfg.backoff_max_s,
            cooldown_s=self.cfg.dead_cooldown_s,
            max_lag=self.config.lag_bound,
        )
        self.follower = VersionFollower(
            self.transport,
            self.names,
            client_id=f"{self.actor_id}-versions",
            on_version=lambda _wv: self._wake_from_thread(loop),
        ).start()
        self._apply_members(list(read_members(self.transport, self.names, self.serde).values()))
        self.members = follow_members(self.transport, self.names, f"{self.actor_id}-servers")
        self.consumer = self.transport.consumer(self.group, self.actor_id, self.instance_id)
        self.producer = self.transport.producer(self.actor_id)
        try:
            self.consumer.subscribe([self.topic], on_assign=self._on_assign, on_revoke=self._on_revoke)
            await self._refresh(force=True)
            heap.settle()
            await self._loop(max_records, idle_timeout_s)
            await self._drain()
        finally:
            for task in list(self._tasks.values()):
                task.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
            self.follower.stop()
            self.members.stop()
            await self.pool.aclose()
            try:
                await asyncio.to_thread(self.consumer.close)
            finally:
                self.producer.close()
        self.stats.extra["samples"] = float(self.stats.records_out)
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
    tokenizer: Tokenizer | None = None,
) -> StageStats:
    """Run the actor until stopped, `max_records` problems taken, or `idle_timeout_s` without work.
    `client_factory(url)` replaces the HTTP client and `tokenizer` (render/decode) the model's
    tokenizer of multi-turn tasks (tests)."""
    actor = Actor(
        config,
        open_transport(config, transport),
        stop if stop is not None else StopFlag(),
        instance,
        client_factory,
        tokenizer,
    )
    return asyncio.run(actor.run(max_records, idle_timeout_s))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_stage_arguments(parser)


def main(args: argparse.Namespace) -> int:
    return run_stage_command("actor", run, args)
