"""The trainer stage on the in-memory transport with a tiny model and a fake weight sender:
step boundaries, lineage, pushes, DLQ, stop/resume and re-trained versions after a crash."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fakes.training import (
    FakePusher,
    make_batches,
    make_tiny_model,
    produce_batches,
    setup_topics,
    stage_config,
)

from stream_rl.contracts import TrainingBatch, WeightVersion, WeightVersionKind
from stream_rl.errors import WeightSyncError
from stream_rl.kafka.memory import MemoryTransport
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.stage import StopFlag
from stream_rl.kafka.topics import TRAINING_BATCHES, WEIGHT_VERSIONS, TopicNames
from stream_rl.stages import trainer as trainer_stage
from stream_rl.train import server_sync
from stream_rl.train.checkpoint import latest_checkpoint, read_state

pytestmark = pytest.mark.unit

SERDE = default_serde()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


make_config = stage_config


def versions(transport: MemoryTransport, names: TopicNames) -> list[WeightVersion]:
    return [SERDE.decode(m.value, WeightVersion) for m in transport.messages(names.topic(WEIGHT_VERSIONS))]


def test_steps_versions_pushes_and_records(tmp_path: Path, model_dir: Path) -> None:
    transport = MemoryTransport()
    names = setup_topics(transport, "r1", make_batches(6, 2, seed=1))
    pusher = FakePusher(drop_at=2)
    cfg = make_config(tmp_path, model_dir, max_steps=3)
    stats = trainer_stage.run(cfg, transport, pusher=pusher, idle_timeout_s=0.5)
    assert stats.stopped_by == "max_steps" and stats.version == 3 and pusher.closed
    wvs = versions(transport, names)
    assert [w.version for w in wvs] == [0, 1, 2, 3]
    assert [w.kind for w in wvs] == [WeightVersionKind.INIT] + [WeightVersionKind.UPDATE] * 2 + [
        WeightVersionKind.FINAL
    ]
    assert [w.samples_trained for w in wvs] == [0, 4, 8, 12]
    assert [w.tokens_trained > 0 for w in wvs] == [False, True, True, True]
    assert [[o.offset for o in w.consumed_offsets] for w in wvs] == [[], [2], [4], [6]]
    # Every version was pushed before it was published, with the published checksum.
    assert pusher.pushed == [(w.version, w.checksum) for w in wvs]
    assert len({w.checksum for w in wvs}) == 4
    assert wvs[2].servers_failed == ["http://b:2"] and wvs[3].servers_updated == ["http://a:1"]
    for key in ("loss", "grad_norm", "lr", "version_lag_mean", "ratio_mean", "ess", "tokens_per_s", "step_s"):
        assert key in wvs[1].metrics, key
    assert wvs[1].metrics["version_lag_max"] == 0.0 and wvs[3].metrics["version_lag_max"] == 2.0
    # Records for replay, a final checkpoint, offsets committed after it.
    run_dir = tmp_path / "runs" / "r1" / "trainer"
    assert json.loads((run_dir / "record" / "init.json").read_text())["checksum"] == wvs[0].checksum
    assert (run_dir / "record" / "config.yaml").is_file()
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    assert ckpt is not None and read_state(ckpt).checksum == wvs[3].checksum
    assert wvs[3].checkpoint_uri == ckpt.resolve().as_uri()
    assert transport.group_offsets(names.group("trainer"), names.topic(TRAINING_BATCHES)) == {0: 6}


def test_filtered_samples_count_toward_the_step(tmp_path: Path, model_dir: Path) -> None:
    transport = MemoryTransport()
    batches = make_batches(4, 2, seed=2, filtered_every=1)  # each: 2 trained + 1 filtered
    batches.append(TrainingBatch("only-filtered", "r1", [], "p", num_filtered=4))
    names = setup_topics(transport, "r1", batches)
    trainer_stage.run(make_config(tmp_path, model_dir), transport, idle_timeout_s=0.5)
    wvs = versions(transport, names)
    # 3 consumed per batch: steps close after batches 2 and 4 (6 >= 4); the empty batch makes a step
    # of filtered samples only, which leaves the weights unchanged.
    assert [(w.samples_trained, w.samples_filtered) for w in wvs] == [(0, 0), (4, 2), (8, 4), (8, 8)]
    assert wvs[3].checksum == wvs[2].checksum
    assert [w.samples_consumed for w in wvs] == [0, 6, 12, 16]


def test_bad_records_go_to_the_dlq(tmp_path: Path, model_dir: Path) -> None:
    transport = MemoryTransport()
    good = make_batches(2, 2, seed=3)
    out_of_vocab = make_batches(1, 1, seed=4, vocab_size=1000)[0]
    names = setup_topics(transport, "r1", [good[0], b"not avro", out_of_vocab, good[1]])
    stats = trainer_stage.run(make_config(tmp_path, model_dir), transport, idle_timeout_s=0.5)
    dlq = transport.messages(names.dlq(TRAINING_BATCHES))
    assert stats.dlq == 2 and len(dlq) == 2
    assert dlq[0].header("original.offset") == b"1" and b"vocabulary" in (dlq[1].header("error") or b"")
    wvs = versions(transport, names)
    assert [w.version for w in wvs] == [0, 1]
    assert wvs[1].consumed_offsets[0].offset == 4 and wvs[1].samples_trained == 4


def reference_checksums(
    tmp_path: Path, model_dir: Path, batches: list[TrainingBatch], **kw: Any
) -> list[str]:
    transport = MemoryTransport()
    names = setup_topics(transport, "ref", batches)
    trainer_stage.run(
        make_config(tmp_path / "ref", model_dir, run="ref", **kw), transport, idle_timeout_s=0.5
    )
    return [w.checksum for w in versions(transport, names)]


def test_stop_mid_step_then_resume_matches_uninterrupted(tmp_path: Path, model_dir: Path) -> None:
    batches = make_batches(8, 2, seed=5)
    ref = reference_checksums(tmp_path, model_dir, batches)
    assert len(ref) == 5
    transport = MemoryTransport()
    names = setup_topics(transport, "r1", batches[:5])  # 2 steps and half of a third
    cfg = make_config(tmp_path, model_dir)
    first = trainer_stage.run(cfg, transport, idle_timeout_s=0.5)
    assert first.stopped_by == "idle_timeout" and first.version == 2
    ckpt = latest_checkpoint(tmp_path / "runs" / "r1" / "trainer" / "checkpoints")
    assert ckpt is not None and read_state(ckpt).offsets == {(names.topic(TRAINING_BATCHES), 0): 4}
    assert transport.group_offsets(names.group("trainer"), names.topic(TRAINING_BATCHES)) == {0: 4}
    produce_batches(transport, names, batches[5:])
    second = trainer_stage.run(cfg, transport, idle_timeout_s=0.5)
    assert second.version == 4 and second.published == 2  # version 2 re-broadcast, not re-published
    assert [w.checksum for w in versions(transport, names)] == ref


def test_crash_after_publishing_retrains_and_verifies(tmp_path: Path, model_dir: Path) -> None:
    batches = make_batches(10, 2, seed=6)
    ref = reference_checksums(tmp_path, model_dir, batches, checkpoint_every=2)
    transport = MemoryTransport()
    names = setup_topics(transport, "r1", batches)
    cfg = make_config(tmp_path, model_dir, checkpoint_every=2)
    with pytest.raises(WeightSyncError):
        trainer_stage.run(cfg, transport, pusher=FakePusher(crash_at=4), idle_timeout_s=0.5)
    assert [w.version for w in versions(transport, names)] == [0, 1, 2, 3]
    pusher = FakePusher()
    stats = trainer_stage.run(cfg, transport, pusher=pusher, idle_timeout_s=0.5)
    # Resumed at the step-2 checkpoint: 2 re-broadcast, 3 re-trained and verified, 4 and 5 new.
    assert pusher.pushed[0][0] == 2 and stats.verified == 2 and stats.mismatches == 0
    wvs = versions(transport, names)
    assert [w.version for w in wvs] == [0, 1, 2, 3, 4, 5]
    assert [w.checksum for w in wvs] == ref


def test_stop_flag_stops_between_micro_batches(tmp_path: Path, model_dir: Path) -> None:
    transport = MemoryTransport()
    names = setup_topics(transport, "r1", make_batches(3, 2, seed=7))
    stop = StopFlag()
    stop.set("received SIGTERM")
    stats = trainer_stage.run(make_config(tmp_path, model_dir), transport, stop=stop)
    assert stats.stopped_by == "received SIGTERM" and stats.version == 0
    assert [w.version for w in versions(transport, names)] == [0]  # version 0 still published


def test_sigterm_checkpoints_the_last_step_and_commits(tmp_path: Path, model_dir: Path) -> None:
    """A real SIGTERM to this process while the trainer waits for input mid-step."""
    import os
    import signal
    import threading
    import time

    from prometheus_client import generate_latest

    transport = MemoryTransport()
    names = setup_topics(transport, "r1", make_batches(5, 2, seed=8))  # 2 steps and half a third
    stop = StopFlag()
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    stop.install_signal_handlers()

    def kill_after_version_2() -> None:
        deadline = time.monotonic() + 60
        while len(versions(transport, names)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=kill_after_version_2, daemon=True)
    killer.start()
    try:
        stats = trainer_stage.run(make_config(tmp_path, model_dir), transport, stop=stop)  # no bound
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    killer.join()
    assert stats.stopped_by == "received SIGTERM" and stats.version == 2
    ckpt = latest_checkpoint(tmp_path / "runs" / "r1" / "trainer" / "checkpoints")
    assert ckpt is not None and ckpt.name == "step-000002"
    assert transport.group_offsets(names.group("trainer"), names.topic(TRAINING_BATCHES)) == {0: 4}
    # The step's numbers are on /metrics too.
    text = generate_latest().decode()
    assert "stream_rl_trainer_version 2.0" in text
    assert 'stream_rl_trainer_step{metric="grad_norm"}' in text
    assert "stream_rl_trainer_version_lag_bucket" in text


def test_a_server_back_while_no_step_completes_gets_the_current_version_at_once(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The chaos run's deadlock: the only server restarted with its initial weights, the actors
    # route to no server older than the bound, so no sample (hence no step) comes until it holds
    # the current version: the trainer must push it while idle, not at the next step.
    transport = MemoryTransport()
    setup_topics(transport, "r1", [])
    pusher = FakePusher(drop_at=0)  # b drops at the first push
    rejoined: list[str] = []

    def rejoin(p: FakePusher, urls: list[str]) -> bool:
        if "http://b:2" in p.live_servers:
            return False
        p.live.append("http://b:2")
        p.drop_at = None  # back for good
        rejoined.append("http://b:2")
        return True

    monkeypatch.setattr(server_sync, "rejoin_dropped", rejoin)
    monkeypatch.setattr(server_sync, "RECONNECT_EVERY_S", 0.0)
    stats = trainer_stage.run(
        make_config(tmp_path, model_dir, max_steps=3), transport, pusher=pusher, idle_timeout_s=0.5
    )
    assert stats.version == 0 and stats.stopped_by == "idle_timeout"
    assert rejoined == ["http://b:2"]  # once: after that it is live
    assert [v for v, _ in pusher.pushed] == [0, 0]  # the first push, then the re-joined server's
    assert pusher.pushed[0][1] == pusher.pushed[1][1]


def test_a_server_joining_the_run_is_pushed_the_current_version_and_a_leaving_one_is_forgotten(
    tmp_path: Path, model_dir: Path
) -> None:
    import threading
    import time

    from fakes.records import make_membership

    from stream_rl.kafka.servers_topic import announce

    transport = MemoryTransport()
    names = setup_topics(transport, "r1", [])
    pusher = FakePusher()
    stop = StopFlag()
    stats: list[Any] = []
    cfg = make_config(tmp_path, model_dir, max_steps=3)
    cfg = cfg.model_validate(
        {**cfg.model_dump(), "inference": {"servers": [{"url": u} for u in pusher.urls]}}
    )
    thread = threading.Thread(
        target=lambda: stats.append(trainer_stage.run(cfg, transport, pusher=pusher, stop=stop))
    )
    thread.start()

    def wait(predicate: Any) -> None:
        deadline = time.monotonic() + 30
        while not predicate():
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.02)

    try:
        wait(lambda: len(pusher.pushed) == 1)  # version 0 to the configured servers
        assert pusher.live == ["http://a:1", "http://b:2"]
        announce(transport, names, make_membership("http://c:3"))
        wait(lambda: len(pusher.pushed) == 2)  # joined and pushed version 0 at once
        assert pusher.live == ["http://a:1", "http://b:2", "http://c:3"]
        assert pusher.pushed[1] == pusher.pushed[0]
        announce(transport, names, make_membership("http://a:1", "draining"))
        wait(lambda: "http://a:1" not in pusher.urls)
        assert pusher.live == ["http://b:2", "http://c:3"]
    finally:
        stop.set("test")
        thread.join(30)
    assert stats and stats[0].version == 0


def test_a_start_waits_for_the_configured_servers_not_for_gone_joined_ones() -> None:
    from stream_rl.train.push import connect_servers

    class Half(FakePusher):
        def connect(self) -> dict[str, str]:
            self.live = ["http://a:1"]
            self.calls = getattr(self, "calls", 0) + 1
            return {"http://b:2": "connection refused"}

    joined_before = Half()
    connect_servers(joined_before, 30.0, StopFlag(), retry_s=0.01, optional={"http://b:2"})
    assert joined_before.calls == 1  # b joined the run through the topic earlier: not waited for
    configured = Half()
    connect_servers(configured, 0.05, StopFlag(), retry_s=0.01)
    assert configured.calls > 1  # a configured server is asked until the timeout


def test_versions_count_what_was_consumed_per_problems_partition(tmp_path: Path, model_dir: Path) -> None:
    """Admission's R per partition with several actors (`WeightVersion.consumed_by_partition`):
    trained samples by their `problem_partition`, filtered ones by the batch's counts; a checkpoint
    keeps the totals across a restart."""
    from dataclasses import replace

    batches = make_batches(6, 2, seed=3)
    batches = [
        replace(
            b,
            samples=[replace(s, problem_partition=i % 2) for s in b.samples],
            num_filtered=1,
            filtered_by_partition={2: 1},
        )
        for i, b in enumerate(batches)
    ]
    transport = MemoryTransport()
    names = setup_topics(transport, "r1", batches)
    for steps in (2, 3):  # the second start resumes from the first's checkpoint
        trainer_stage.run(
            make_config(tmp_path, model_dir, max_steps=steps),
            transport,
            pusher=FakePusher(),
            idle_timeout_s=0.5,
        )
    wvs = {w.version: w for w in versions(transport, names)}
    assert sorted(wvs) == [0, 1, 2, 3]
    for w in wvs.values():
        assert w.attributed and sum(w.consumed_by_partition.values()) == w.samples_consumed
    assert wvs[0].consumed_by_partition == {}
    last = wvs[3]
    assert last.consumed_by_partition[2] == last.samples_filtered and last.consumed_by_partition[0] > 0
    assert last.consumed_by_partition[0] + last.consumed_by_partition[1] == last.samples_trained


def test_a_close_that_raises_does_not_skip_the_others(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend is closed first (DeepSpeed: it releases the other ranks); its error is raised
    after the consumer, producer and servers (every weight-sync group) were closed too."""
    from stream_rl.train.step import PolicyTrainer

    def broken_close(self: PolicyTrainer) -> None:
        raise RuntimeError("the backend's close failed")

    monkeypatch.setattr(PolicyTrainer, "close", broken_close)
    transport = MemoryTransport()
    setup_topics(transport, "r1", make_batches(4, 2, seed=1))
    pusher = FakePusher()
    with pytest.raises(RuntimeError, match="the backend's close failed"):
        trainer_stage.run(
            make_config(tmp_path, model_dir, max_steps=1), transport, pusher=pusher, idle_timeout_s=0.5
        )
    assert pusher.closed
