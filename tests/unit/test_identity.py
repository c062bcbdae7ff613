"""Run identity: what starting an existing run name means (new, resume, refused)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fakes.records import make_weight_version

from stream_rl.config import dump_config, load_config
from stream_rl.contracts import WeightVersionKind
from stream_rl.errors import ConfigError, StreamRLError
from stream_rl.run.identity import RunState, config_differences, decide

pytestmark = pytest.mark.unit


def lineage(last: int, final: bool = False):  # type: ignore[no-untyped-def]
    out = []
    for v in range(last + 1):
        wv = make_weight_version(v)
        wv.kind = WeightVersionKind.FINAL if final and v == last else WeightVersionKind.UPDATE
        out.append(wv)
    return out


def config(tmp_path: Path, *overrides: str):  # type: ignore[no-untyped-def]
    return load_config(None, [f"runs_dir={tmp_path}", "run=r1", "trainer.max_steps=10", *overrides])


def record(cfg) -> None:  # type: ignore[no-untyped-def]
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    (cfg.run_dir / "config.yaml").write_text(dump_config(cfg))


def test_a_new_name_starts(tmp_path: Path) -> None:
    assert decide(config(tmp_path), [], "b:1").state == RunState.NEW


def test_a_launch_that_never_trained_starts_again(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    record(cfg)
    identity = decide(config(tmp_path, "trainer.lr=1e-5"), [], "b:1")
    assert identity.state == RunState.NEVER_TRAINED and "never trained" in identity.message


def test_an_unfinished_run_resumes_with_its_config_and_operational_changes(tmp_path: Path) -> None:
    record(config(tmp_path))
    resumed = decide(config(tmp_path, "inference.base_port=9999", "launcher.max_wall_s=5"), lineage(4), "b:1")
    assert resumed.state == RunState.RESUME and resumed.last_version == 4
    assert "resuming run r1 at version 4 of 10" in resumed.message


def test_an_unfinished_run_with_another_config_is_refused_naming_the_keys(tmp_path: Path) -> None:
    record(config(tmp_path))
    with pytest.raises(ConfigError) as err:
        decide(config(tmp_path, "trainer.lr=1e-5", "actor.group_size=4"), lineage(4), "b:1")
    message = str(err.value)
    assert "\n" not in message
    assert "trainer.lr: 0.0003 -> 1e-05" in message and "actor.group_size: 8 -> 4" in message
    assert "--set run=" in message


def test_a_finished_run_is_refused_in_one_line_with_its_summary(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    record(cfg)
    with pytest.raises(StreamRLError) as err:
        decide(cfg, lineage(10, final=True), "b:1")
    message = str(err.value)
    assert "\n" not in message and "has finished (10 versions)" in message
    assert str(cfg.run_dir / "summary.json") in message and "make demo RUN=r1-2" in message


def test_a_directory_the_broker_does_not_know_is_refused(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    record(cfg)
    (cfg.run_dir / "summary.json").write_text('{"versions": {"last": 7}}')
    with pytest.raises(
        StreamRLError, match="records 7 trained versions but the broker at b:1 has no weight-versions"
    ):
        decide(cfg, [], "b:1")


def test_a_lineage_without_its_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StreamRLError, match=r"holds 3 versions of it but .* does not exist"):
        decide(config(tmp_path), lineage(3), "b:1")


def test_keys_missing_from_an_older_record_are_not_differences() -> None:
    assert config_differences({"trainer": {"lr": 1.0}}, {"trainer": {"lr": 1.0}, "eval": {"every": 0}}) == []
    assert config_differences({"trainer": {"lr": 1.0}}, {"trainer": {"lr": 2.0}}) == [
        "trainer.lr: 1.0 -> 2.0"
    ]
