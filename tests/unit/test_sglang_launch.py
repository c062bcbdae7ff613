"""How the launcher starts SGLang servers: the flags (and when each is there), the admin token
passed outside the command line, the release check, and the config checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stream_rl.config import ADMIN_TOKEN_ENV, load_config
from stream_rl.errors import ConfigError
from stream_rl.inference.launching import check_engine, launch_for

pytestmark = pytest.mark.unit

SGLANG = ["inference.engine=sglang", "inference.device=cuda", "trainer.device=cuda", "model.path=/m/qwen"]


def cmd(*overrides: str) -> list[str]:
    return launch_for(load_config(None, [*SGLANG, *overrides]), 1).cmd


def test_the_launch_carries_the_flags_in_flight_rl_needs() -> None:
    line = cmd("inference.base_port=30000", "inference.max_batch=32", "seed=7")
    assert line[1] == "-c" and "runpy.run_module('sglang.launch_server'" in line[2]
    args = line[3:]
    pairs = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
    assert pairs["--model-path"] == "/m/qwen" and pairs["--port"] == "30001"
    assert pairs["--random-seed"] == "8" and pairs["--max-running-requests"] == "32"
    assert pairs["--weight-version"] == "0"
    for flag in ("--disable-radix-cache", "--disable-overlap-schedule", "--enable-deterministic-inference"):
        assert flag in args


def test_flags_follow_the_pause_policy_and_seeding() -> None:
    recompute = cmd("inference.kv_policy=recompute")
    drain = cmd("in_flight_updates=false")
    assert "--disable-overlap-schedule" not in recompute and "--disable-overlap-schedule" not in drain
    assert "--enable-deterministic-inference" not in cmd("actor.seeded_sampling=false")
    assert cmd("inference.sglang.extra_args=[--tp-size, '2']")[-2:] == ["--tp-size", "2"]


def test_the_admin_token_reaches_sglang_from_the_environment_not_the_command(tmp_path: Path) -> None:
    fake = tmp_path / "sglang"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "launch_server.py").write_text("import sys\nprint(sys.argv[1:])\n")
    line = cmd()
    env = {**os.environ, "PYTHONPATH": str(tmp_path), ADMIN_TOKEN_ENV: "s3cret"}
    run = [sys.executable, *line[1:]]
    out = subprocess.run(run, env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("'--admin-api-key', 's3cret']") and "s3cret" not in " ".join(line)
    env.pop(ADMIN_TOKEN_ENV)
    assert "--admin-api-key" not in subprocess.run(run, env=env, capture_output=True, text=True).stdout


def test_other_sglang_releases_are_refused_before_anything_starts(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 0.5.22\n")
    python.chmod(0o755)
    with pytest.raises(ConfigError, match="sglang 0.5.22 .* not supported .*0.5.23"):
        check_engine(load_config(None, [*SGLANG, f"inference.sglang.python={python}"]))
    python.write_text("#!/bin/sh\necho 0.5.23\n")
    assert check_engine(load_config(None, [*SGLANG, f"inference.sglang.python={python}"])) == "0.5.23"


def test_sglang_needs_cuda_on_both_sides() -> None:
    with pytest.raises(ConfigError, match="sglang needs trainer.device: cuda"):
        load_config(None, ["inference.engine=sglang", "inference.device=cuda"])
    with pytest.raises(ConfigError, match="sglang needs inference.device: cuda"):
        load_config(None, ["inference.engine=sglang", "trainer.device=cuda"])
