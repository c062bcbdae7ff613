"""Config: every shipped config loads; bad input gets a one-line error naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from stream_rl.config import RunConfig, dump_config, load_config, parse_overrides
from stream_rl.errors import ConfigError

pytestmark = pytest.mark.unit

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_there_are_configs() -> None:
    assert CONFIGS, "configs/ must hold runnable run configs"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_loads(path: Path) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    # The resolved config round-trips through YAML (the launcher writes it for each stage).
    reloaded = RunConfig.model_validate(__import__("yaml").safe_load(dump_config(cfg)))
    assert reloaded.run == cfg.run


def test_unknown_key_is_named(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("trainer:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError, match=r"trainer\.lrr: unknown key"):
        load_config(p)


def test_bad_value_is_named_with_the_value(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("trainer:\n  lr: -1\n")
    with pytest.raises(ConfigError, match=r"trainer\.lr: .*greater than 0.*got -1"):
        load_config(p)


def test_overrides_are_parsed_as_yaml_and_applied() -> None:
    cfg = load_config(
        None, ["trainer.lr=1e-5", "actor.group_size=4", "run=abc", "actor.sampling.stop=[x, y]"]
    )
    assert cfg.trainer.lr == 1e-5
    assert cfg.actor.group_size == 4
    assert cfg.run == "abc"
    assert cfg.actor.sampling.stop == ["x", "y"]


def test_bad_override_syntax() -> None:
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_overrides(["trainer.lr"])


def test_invalid_yaml_and_missing_file(tmp_path: Path) -> None:
    p = tmp_path / "x.yaml"
    p.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")


def test_conventional_mode_needs_whole_groups() -> None:
    with pytest.raises(ConfigError, match="multiple of actor.group_size"):
        load_config(None, ["mode=conventional", "trainer.samples_per_step=10", "actor.group_size=4"])


def test_secrets_are_masked_in_dumps() -> None:
    cfg = load_config(None, ["inference.admin_token=hunter2"])
    assert "hunter2" not in dump_config(cfg)
    assert cfg.inference.admin_token is not None
    assert cfg.inference.admin_token.get_secret_value() == "hunter2"


def test_the_decode_shape_reaches_launched_builtin_servers_and_is_refused_elsewhere() -> None:
    from stream_rl.inference.launching import launch_for

    cmd = launch_for(load_config(None, ["inference.decode_shape=fixed"]), 0).cmd
    assert cmd[cmd.index("--decode-shape") + 1] == "fixed"
    assert launch_for(load_config(None, []), 0).cmd[cmd.index("--decode-shape") + 1] == "running"
    for overrides in (["inference.engine=vllm"], ["inference.servers=[{url: 'http://h:1'}]"]):
        with pytest.raises(
            ConfigError, match="inference.decode_shape applies to the built-in servers the launcher"
        ):
            load_config(None, ["inference.decode_shape=fixed", *overrides])
