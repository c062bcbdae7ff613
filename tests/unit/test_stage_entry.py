"""The shared stage entry: the trainer's options and transport come from it like every stage's;
one spelling of each server's URL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stream_rl.cli import command_parser
from stream_rl.config import RunConfig, load_config
from stream_rl.errors import ConfigError
from stream_rl.stages.entry import kafka_transport
from stream_rl.stages.routing import server_urls

pytestmark = pytest.mark.unit


def test_the_trainer_is_bounded_by_steps_and_refuses_a_second_instance() -> None:
    parser, trainer = command_parser("trainer")
    args = parser.parse_args(["--max-steps", "3", "--idle-timeout", "1", "--metrics-port", "0"])
    assert (args.max_steps, args.idle_timeout, args.metrics_port, args.instance) == (3, 1.0, 0, "0")
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-records", "3"])  # not a trainer bound: refused, not ignored
    with pytest.raises(ConfigError, match="one trainer per run"):
        trainer.main(parser.parse_args(["--instance", "1"]))


def test_stage_transport_finds_the_local_broker_in_data_dir_and_applies_compression(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STREAM_RL_KAFKA_BOOTSTRAP", raising=False)
    state = {
        "pid": 1,
        "port": 19999,
        "controller_port": 20000,
        "host": "127.0.0.9",
        "version": "x",
        "started_at": 0,
    }
    (tmp_path / "broker.json").write_text(json.dumps(state))
    config = load_config(None, [f"kafka.data_dir={tmp_path}", "kafka.compression=lz4"])
    kafka = kafka_transport(config)
    assert (kafka.bootstrap, kafka.compression) == ("127.0.0.9:19999", "lz4")


def test_one_spelling_of_a_server_url() -> None:
    config = RunConfig.model_validate(
        {"inference": {"servers": [{"url": " http://a:1/ "}, {"url": "https://b:2//"}]}}
    )
    assert config.inference.server_urls() == ["http://a:1", "https://b:2"]
    assert server_urls(config) == config.inference.server_urls()
    with pytest.raises(ValueError, match="expected a base URL"):
        RunConfig.model_validate({"inference": {"servers": [{"url": "a:1"}]}})
