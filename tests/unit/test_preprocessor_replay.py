"""`replay preprocessor` on the in-memory transport: a run's `scored` re-derived with other settings
into a new run, exactly once, the source run untouched; R2's config; the `replay` dispatcher."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from fakes.records import f32, make_scored_groups

from stream_rl.cli import command_parser
from stream_rl.config import RunConfig, dump_config, load_config
from stream_rl.contracts import ScoredRollout, TrainingBatch
from stream_rl.errors import ConfigError
from stream_rl.kafka.memory import MemoryTransport
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.topics import SCORED, TRAINING_BATCHES, TopicNames
from stream_rl.stages.preprocessor_replay import replay_config, replay_preprocessor, source_config_path

pytestmark = pytest.mark.unit
serde = default_serde()
SRC = TopicNames("src")

# Groups 0-3 have distinct rewards, group 4 all equal (zero advantage), group 5 is incomplete.
REWARDS = [[1, 0, 0, 1], [1, 1, 1, 0], [0, 0, 0, 1], [0.5, 0, 1, 0.25], [1, 1, 1, 1], [1, 0]]


def group_rewards() -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for s in make_scored_groups(REWARDS, group_size=4, run_id="src"):
        out.setdefault(s.rollout.group_id, []).append(s.reward)
    return out


def source_run() -> tuple[MemoryTransport, list[ScoredRollout]]:
    t = MemoryTransport()
    t.create_topics(SRC.all_topics(partitions=2))
    records = make_scored_groups(REWARDS, group_size=4, run_id="src")
    records.append(records[1])  # a re-delivered sample: a duplicate
    random.Random(7).shuffle(records)
    p = t.producer("verifier")
    for s in records:
        p.produce(SRC[SCORED], serde.encode(s), key=s.rollout.group_id)
    return t, records


def src_config(tmp_path: Path) -> Path:
    cfg = RunConfig.model_validate(
        {
            "run": "src",
            "runs_dir": str(tmp_path / "runs"),
            "preprocessor": {"batch_size": 5},
            "inference": {"servers": [{"url": "http://server-a:8100"}]},
            "trainer": {"checkpoint_dir": str(tmp_path / "runs/src/ckpt")},
        }
    )
    path = tmp_path / "runs" / "src" / "config.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(dump_config(cfg))
    return path


def batches(t: MemoryTransport, run: str) -> list[TrainingBatch]:
    return [serde.decode(m.value, TrainingBatch) for m in t.messages(TopicNames(run)[TRAINING_BATCHES])]


def snapshot(t: MemoryTransport, names: TopicNames) -> dict[str, int]:
    """Record counts of the run's own topics (the cluster-wide `_schemas` is shared)."""
    own = f"{names.prefix}.{names.run}."
    return {name: len(t.messages(name)) for name, _, _ in names.all_topics() if name.startswith(own)}


def test_replay_rederives_every_complete_group_once_with_the_new_advantages(tmp_path: Path) -> None:
    t, _ = source_run()
    before = snapshot(t, SRC)
    source, target = replay_config(
        src_config(tmp_path),
        "src",
        "abl",
        ["preprocessor.advantage=mean", "preprocessor.filter_zero_advantage=true"],
    )
    summary = replay_preprocessor(source, target, t, idle_timeout_s=10)
    assert summary.exhausted and summary.stopped_by == f"end of {SRC[SCORED]}"
    assert summary.records == 23 and summary.duplicates == 1
    assert (summary.groups, summary.filtered_groups, summary.filtered_samples) == (5, 1, 4)
    assert summary.incomplete_groups == 1 and summary.samples == 16
    assert summary.settings == {"advantage": ("loo", "mean"), "filter_zero_advantage": (False, True)}

    got = batches(t, "abl")
    assert {b.producer_id for b in got} == {"preprocessor-replay"} and all(b.run_id == "abl" for b in got)
    assert sum(b.num_filtered for b in got) == 4
    samples = [s for b in got for s in b.samples]
    assert sorted(s.rollout_id for s in samples) == sorted(
        s.rollout.rollout_id for s in make_scored_groups(REWARDS[:4], run_id="src")
    )  # groups 0-3, each sample exactly once; not the filtered group 4 nor the incomplete group 5
    abs_sum, rewards = 0.0, group_rewards()
    for s in samples:
        group = rewards[s.group_id]
        expected = s.reward - sum(group) / len(group)  # the group-mean baseline, not leave-one-out
        assert all(a == f32(expected) for a, m in zip(s.advantages, s.loss_mask, strict=True) if m)
        abs_sum += abs(expected)
    assert summary.mean_abs_advantage == pytest.approx(abs_sum / 16)

    # The source run is untouched: same records everywhere, its groups have committed nothing.
    assert snapshot(t, SRC) == before
    assert t.group_offsets(SRC.group("preprocessor"), SRC[SCORED]) == {0: -1, 1: -1}

    # A second replay into the same run resumes at its committed end: nothing is written twice.
    again = replay_preprocessor(source, target, t, idle_timeout_s=10)
    assert again.exhausted and again.records == 0
    assert len(batches(t, "abl")) == len(got)


def test_default_settings_reproduce_leave_one_out(tmp_path: Path) -> None:
    t, _ = source_run()
    source, target = replay_config(src_config(tmp_path), "src", "same", [])
    summary = replay_preprocessor(source, target, t, idle_timeout_s=10)
    assert summary.settings == {} and summary.groups == 5 and summary.samples == 20
    rewards = group_rewards()
    for s in (s for b in batches(t, "same") for s in b.samples):
        group = rewards[s.group_id]
        n = len(group)
        loo = s.reward - (sum(group) - s.reward) / (n - 1)
        assert all(a == f32(loo) for a, m in zip(s.advantages, s.loss_mask, strict=True) if m)


def test_replay_config_renames_runs_offline_and_lets_overrides_win(tmp_path: Path) -> None:
    path = src_config(tmp_path)
    source, target = replay_config(path, "src", "abl", ["preprocessor.divide_by_std=true"])
    assert source.run == "src" and target.run == "abl"
    assert target.preprocessor.divide_by_std and not source.preprocessor.divide_by_std
    assert target.inference.servers == [] and target.inference.num_servers == 0
    assert target.trainer.checkpoint_dir is None  # not the source run's checkpoints
    assert target.run_dir == tmp_path / "runs" / "abl"
    _, served = replay_config(path, "src", "abl", ["inference.num_servers=1"])
    assert served.inference.num_servers == 1
    assert load_config(path).run == "src"  # the source's file is only read
    with pytest.raises(ConfigError, match="new run"):
        replay_config(path, "src", "src", [])
    with pytest.raises(ConfigError, match="contradicts"):
        replay_config(path, "src", "abl", ["run=other"])
    assert source_config_path(tmp_path / "runs", "src") == path
    with pytest.raises(ConfigError, match="not found"):
        source_config_path(tmp_path / "runs", "nope")


def test_replay_command_dispatches_on_the_stage() -> None:
    parser, _ = command_parser("replay")
    args = parser.parse_args(
        ["preprocessor", "--run", "a", "--into", "b", "--set", "preprocessor.advantage=mean"]
    )
    assert (args.stage, args.run, args.into, args.overrides) == (
        "preprocessor",
        "a",
        "b",
        ["preprocessor.advantage=mean"],
    )
    args = parser.parse_args(["trainer", "--run", "a", "--model", "m"])
    assert (args.stage, args.run, args.model) == ("trainer", "a", "m")
    with pytest.raises(SystemExit):
        parser.parse_args(["verifier", "--run", "a"])
    with pytest.raises(SystemExit):
        parser.parse_args(["preprocessor", "--run", "a"])  # --into is required


def test_run_and_runs_dir_names_stay_strings(tmp_path: Path) -> None:
    _, target = replay_config(src_config(tmp_path), "src", "2024", [], runs_dir=tmp_path / "007")
    assert target.run == "2024" and target.run_dir == tmp_path / "007" / "2024"
