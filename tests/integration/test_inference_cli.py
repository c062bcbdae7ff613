"""`stream-rl make-model` and `stream-rl serve` as a user runs them (the server in its own process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from stream_rl import cli

pytestmark = pytest.mark.integration


def stream_rl(*args: str) -> list[str]:
    return [sys.executable, "-m", "stream_rl.cli", *args]


def test_make_model_then_serve_then_sigterm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiny"
    assert cli.main(["make-model", "--preset", "tiny", "--out", str(out), "--seed", "3"]) == 0
    assert "parameters" in capsys.readouterr().out
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert cli.main(["make-model", "--out", str(out)]) == 2
    assert "already holds a model" in capsys.readouterr().err

    port_file = tmp_path / "port"
    env = {**os.environ, "STREAM_RL_ADMIN_TOKEN": "tok"}
    server = subprocess.Popen(
        stream_rl(
            "serve", "--model", str(out), "--port", "0", "--port-file", str(port_file), "--max-batch", "8"
        ),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists():
            assert server.poll() is None, server.communicate()[1]
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        url = f"http://127.0.0.1:{int(port_file.read_text())}"
        while True:  # the port file is written just before uvicorn starts accepting
            try:
                health = httpx.get(f"{url}/health")
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert health.json() == {"status": "ok", "version": 0}
        assert httpx.get(f"{url}/weights/version").status_code == 401  # token from the environment
        answer = httpx.post(
            f"{url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "1+1="}], "max_tokens": 4},
        )
        assert answer.status_code == 200 and len(answer.json()["choices"][0]["token_ids"]) <= 4
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            raise
    assert code == 0


def test_serve_reports_bad_options_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--model", str(tmp_path / "missing")]) == 2
    assert "not a model directory" in capsys.readouterr().err
    assert cli.main(["serve", "--model", str(tmp_path), "--max-batch", "0"]) == 2
    assert "max_batch" in capsys.readouterr().err
