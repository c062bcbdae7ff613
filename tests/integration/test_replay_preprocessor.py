"""`stream-rl replay preprocessor` on a real broker, through the CLI: a run's scored rollouts
re-derived with the group-mean baseline into a new run (every complete group exactly once, the
source run untouched), then a trainer trains on the new run and `replay trainer` reproduces it."""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest
from fakes.records import f32, make_scored_groups
from fakes.training import make_tiny_model
from stage_helpers import make_config, read

from stream_rl import cli
from stream_rl.config import dump_config, load_config
from stream_rl.contracts import TrainingBatch
from stream_rl.kafka.confluent import KafkaTransport
from stream_rl.kafka.reader import settled
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.topics import SCORED, TRAINING_BATCHES, TopicNames
from stream_rl.stages import trainer as trainer_stage

pytestmark = pytest.mark.integration
serde = default_serde()

# Groups 0-4 complete (group 3 all equal: zero advantages), group 5 incomplete.
REWARDS = [[1, 0, 0, 1], [1, 1, 1, 0], [0, 0, 0, 1], [1, 1, 1, 1], [0.5, 0, 1, 0.25], [0, 1]]


def cli_main(argv: list[str]) -> int:
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return cli.main(argv)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def own_topics(kafka: KafkaTransport, names: TopicNames) -> dict[str, dict[int, tuple[int, int]]]:
    own = f"{names.prefix}.{names.run}."
    return {name: kafka.watermarks(name) for name, _, _ in names.all_topics() if name.startswith(own)}


def test_replay_preprocessor_into_a_new_run_then_train_on_it(  # type: ignore[no-untyped-def]
    kafka, kafka_bootstrap: str, run_names: TopicNames, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = tmp_path / "runs"
    model = make_tiny_model(tmp_path / "model")
    config = make_config(
        run_names,
        kafka_bootstrap,
        runs_dir=str(runs),
        model={"path": str(model)},
        trainer={"samples_per_step": 8, "lr": 1e-3},
    )
    (runs / run_names.run).mkdir(parents=True)
    (runs / run_names.run / "config.yaml").write_text(dump_config(config))
    records = make_scored_groups(REWARDS, group_size=4, run_id=run_names.run)
    random.Random(3).shuffle(records)
    # Written in two transactions, as a transactional producer would: the end check of the replay
    # must step over the commit markers that end each partition.
    producer = kafka.producer("test-verifier", transactional_id=f"{run_names.run}-test-verifier")
    producer.init_transactions()
    for part in (records[:10], records[10:]):
        producer.begin_transaction()
        for s in part:
            producer.produce(run_names[SCORED], serde.encode(s), key=s.rollout.group_id)
        producer.commit_transaction()
    producer.close()
    # The last commit's markers reach the partitions after it returns: the ends are read once they
    # have (a loaded run read the committed ends 6 and 6 here, and 14 and 12 after the replay).
    settled(kafka, run_names[SCORED], None, 60)
    before = own_topics(kafka, run_names)

    into = run_names.run + "mean"
    code = cli_main(
        [
            "replay",
            "preprocessor",
            "--run",
            run_names.run,
            "--into",
            into,
            "--runs-dir",
            str(runs),
            "--set",
            "preprocessor.advantage=mean",
            "--bootstrap",
            kafka_bootstrap,
            "--idle-timeout",
            "30",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "consumed  22 scored records (end reached)" in out
    assert "5 complete, 0 of them filtered" in out and "1 incomplete" in out, out

    # Every complete group exactly once, with group-mean advantages.
    dst = TopicNames(into, run_names.prefix)
    batches = [serde.decode(m.value, TrainingBatch) for m in read(kafka, dst[TRAINING_BATCHES])]
    samples = [s for b in batches for s in b.samples]
    complete = make_scored_groups(REWARDS[:5], run_id=run_names.run)
    assert sorted(s.rollout_id for s in samples) == sorted(s.rollout.rollout_id for s in complete)
    rewards: dict[str, list[float]] = {}
    for s in complete:
        rewards.setdefault(s.rollout.group_id, []).append(s.reward)
    for s in samples:
        group = rewards[s.group_id]
        mean_baseline = s.reward - sum(group) / len(group)
        assert all(a == f32(mean_baseline) for a, m in zip(s.advantages, s.loss_mask, strict=True) if m)

    # The source run is untouched: its topics hold what they held, its groups committed nothing.
    assert own_topics(kafka, run_names) == before
    assert set(kafka.group_offsets(run_names.group("preprocessor"), run_names[SCORED]).values()) == {-1}

    # The new run's config: renamed, offline, the override in; a trainer trains on it.
    written = load_config(runs / into / "config.yaml")
    assert written.run == into and written.preprocessor.advantage == "mean"
    assert written.inference.servers == [] and written.inference.num_servers == 0
    assert (runs / into / "replay.json").is_file()
    stats = trainer_stage.run(written, kafka, idle_timeout_s=2)
    assert stats.version == 2 and stats.dlq == 0  # 20 samples, 8 per step
    assert (
        cli_main(
            ["replay", "trainer", "--run", into, "--runs-dir", str(runs), "--bootstrap", kafka_bootstrap]
        )
        == 0
    )
    assert "3/3 versions match" in capsys.readouterr().out
