"""`make gpu-extra-check` inside the suite: the unit tier and the vLLM 0.33 contract tests (marker
`vllm033`) in the `gpu` extra's environment (vLLM 0.33, torch 2.14, transformers 5.20: the other
end of our torch and transformers ranges, and the versions a `pip install "stream-rl[gpu]"` gets),
with this checkout on PYTHONPATH. One process beside the other tiers rather than three workers
before them: the unit tier is half waiting (one process: ~85 s for ~40 s of CPU, 2026-12-07), so
here it fills the time the e2e tests spend waiting on faults and timeouts, where on its own it
held `make test` ~55 s.

The environment is `make gpu-extra`'s (`make test` builds it first and names it in
$STREAM_RL_GPU_EXTRA_ENV); a missing one fails, never skips."""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections import Counter
from pathlib import Path
from xml.etree import ElementTree

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
GPU_EXTRA_ENV = "STREAM_RL_GPU_EXTRA_ENV"


def gpu_extra_home() -> Path:
    """The environment `make gpu-extra` builds: named by the lock's hash (the Makefile's
    GPU_EXTRA_HOME), unless $STREAM_RL_GPU_EXTRA_ENV names one."""
    given = os.environ.get(GPU_EXTRA_ENV)
    if given:
        return Path(given)
    cache = Path(os.environ.get("CACHE", Path.home() / ".cache" / "stream-rl"))
    digest = hashlib.sha1((REPO / "uv.lock").read_bytes()).hexdigest()[:12]
    return cache / "venvs" / f"gpu-extra-{digest}"


def test_the_unit_tier_and_the_vllm_033_contracts_pass_in_the_gpu_extras_environment(tmp_path: Path) -> None:
    home = gpu_extra_home()
    if not (home / ".complete").is_file():
        pytest.fail(f"the gpu extra's environment is not built at {home}: run `make gpu-extra`")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "STREAM_RL_TEST_"))}
    env["PYTHONPATH"] = str(REPO)
    junit = tmp_path / "junit.xml"
    cmd = [str(home / "bin" / "pytest"), "-p", "no:cacheprovider", "-m", "unit or vllm033", "-q"]
    cmd += ["--basetemp", str(tmp_path / "basetemp"), "--junitxml", str(junit)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=800)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    cases = ElementTree.parse(junit).getroot().iter("testcase")
    outcomes = Counter((c.get("classname", "").rsplit(".", 1)[-1], _outcome(c)) for c in cases)
    # The contract tests ran against vLLM 0.33 itself, none skipped; no unit test skipped either.
    assert outcomes[("test_vllm033_contract", "passed")] >= 5, outcomes
    assert all(outcome == "passed" for (_, outcome) in outcomes), [k for k in outcomes if k[1] != "passed"]
    print(done.stdout.strip().splitlines()[-1])


def _outcome(case: ElementTree.Element) -> str:
    """A JUnit test case's outcome: the tag of its skipped, failure or error element, else passed."""
    return next((x.tag for x in case if x.tag in ("skipped", "failure", "error")), "passed")
