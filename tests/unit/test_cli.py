"""The CLI: errors a user can act on are one line (plus one per bad key), never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from stream_rl.cli import main

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def test_bad_config_value_is_one_line_naming_the_key(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["run", str(REPO / "configs" / "demo-cpu.yaml"), "--set", "trainer.lr=-1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err == [
        f"error: {REPO / 'configs' / 'demo-cpu.yaml'}: trainer.lr: Input should be greater than 0 (got -1)"
    ]


def test_unknown_key_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["run", str(REPO / "configs" / "demo-cpu.yaml"), "--set", "actor.grup_size=4"])
    assert rc == 2
    assert "actor.grup_size: unknown key" in capsys.readouterr().err


def test_missing_config_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc = main(["run", str(tmp_path / "nope.yaml")])
    assert rc == 2
    assert "cannot read config" in capsys.readouterr().err


def test_kafka_host_is_refused_where_it_would_be_ignored(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    for args in (["status"], ["up", "--brokers", "3"]):
        rc = main(["kafka", *args, "--host", "10.0.0.1", "--data-dir", str(tmp_path / "k")])
        assert rc == 2
        assert capsys.readouterr().err.strip() == (
            "error: --host: only for `kafka up` of one broker (a local cluster listens on 127.0.0.1)"
        )


def test_every_command_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    from stream_rl.cli import COMMANDS, command_parser

    for name, _, _ in COMMANDS:
        parser, _ = command_parser(name)
        assert parser.format_help().startswith(f"usage: stream-rl {name}")


def test_a_taken_server_port_is_a_clear_error(tmp_path: Path) -> None:
    import socket

    from stream_rl.config import load_config
    from stream_rl.errors import StreamRLError
    from stream_rl.kafka.stage import StopFlag
    from stream_rl.run.launch import Launcher

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cfg = load_config(None, [f"runs_dir={tmp_path}", f"inference.base_port={port}"])
        launcher = Launcher(cfg, StopFlag())
        launcher.bootstrap = "127.0.0.1:1"
        launcher.plan()
        with pytest.raises(StreamRLError, match=f"port {port} for server-0 is taken"):
            launcher.check_server_ports()


def test_servers_commands_refuse_what_they_would_ignore_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cases = {
        ("join",): "error: servers join needs --url (the server's base URL)",
        (
            "leave",
            "--url",
            "10.0.0.7:8001",
        ): "error: --url: expected a base URL like http://host:port, got '10.0.0.7:8001'",
        ("list", "--url", "http://a:1"): "error: servers list takes no --url or --engine",
        ("leave", "--url", "http://a:1", "--no-wait"): "error: --no-wait is for join",
    }
    for args, line in cases.items():
        rc = main(["servers", *args, "--bootstrap", "127.0.0.1:1"])
        assert rc == 2 and capsys.readouterr().err.strip() == line, args


def test_scale_refuses_in_one_line_what_it_cannot_do(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    runs = ["--run", "r", "--runs-dir", str(tmp_path)]
    cases = {
        (
            "actor=two",
        ): "error: 'actor=two': expected ROLE=N with ROLE one of actor, verifier, preprocessor, server and N a count",
        (
            "trainer=2",
        ): "error: 'trainer=2': expected ROLE=N with ROLE one of actor, verifier, preprocessor, server and N a count",
        ("actor=1", "actor=2"): "error: actor given twice",
        (
            "actor=1",
        ): f"error: run r has no launcher running ({tmp_path / 'r' / 'processes.json'}): `scale` changes "
        "launcher-managed runs; scale stages started by hand by starting or stopping them (README 'Scaling during a run')",
    }
    for args, line in cases.items():
        assert main(["scale", *runs, *args]) == 2 and capsys.readouterr().err.strip() == line, args


def test_the_launcher_checks_every_count_before_it_scales_anything(tmp_path: Path) -> None:
    from stream_rl.config import load_config
    from stream_rl.errors import StreamRLError
    from stream_rl.kafka.stage import StopFlag
    from stream_rl.run.launch import Launcher

    config = load_config(None, [f"runs_dir={tmp_path}", "launcher.actors=2"])
    launcher = Launcher(config, StopFlag())
    launcher._shares_by_partition = lambda: True  # type: ignore[method-assign]
    launcher._check({"actor": 3})  # actors share the bound by partition: any number
    launcher._shares_by_partition = lambda: False  # type: ignore[method-assign]  # an older lineage
    for counts, message in (
        ({"actor": 3}, "actor=3: at most launcher.actors (2) for this run"),
        ({"verifier": 0}, "verifier=0: a run needs at least one verifier"),
    ):
        with pytest.raises(StreamRLError, match=message.replace("(", r"\(").replace(")", r"\)")):
            launcher._check(counts)
    hand = load_config(None, [f"runs_dir={tmp_path}", "inference.servers=[{url: 'http://a:1'}]"])
    with pytest.raises(StreamRLError, match="not launched: add others with `stream-rl servers join`"):
        Launcher(hand, StopFlag())._check({"server": 2})
