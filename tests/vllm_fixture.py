"""A real vLLM server (the CPU build in `.venv-vllm`, `make vllm`) for the tests, started with the
launcher's own command line (`stream_rl.inference.launching.launch_for`).

vLLM takes a minute or more to start on two cores: `tests/conftest.py` starts the session's
server when a test first needs it (the vLLM files are scheduled first, as one xdist work unit, so
the other workers run meanwhile) and stops it after the last test that needs it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("STREAM_RL_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
"""The CPU build's environment; bench/gpu_vllm_check.sh points it at a GPU machine's vLLM."""
VLLM_DEVICE = os.environ.get("STREAM_RL_VLLM_DEVICE", "cpu")
"""`cuda` on a GPU machine (bench/gpu_vllm_check.sh): the server on the GPU, the tests' trainer
on the CPU over stream_rl_gloo (one GPU: NCCL refuses a trainer and a server on one device)."""
VLLM_EAGER = os.environ.get("STREAM_RL_VLLM_EAGER", "1") == "1"
"""On `cuda`, `0` runs vLLM with CUDA graphs (the default of a GPU user's server)."""
TOKEN = "vllm-test-token"
DEMO_BATCH = 128
"""`inference.max_batch` of configs/demo-cpu.yaml (tests/e2e/test_vllm_demo.py checks they agree)."""
HUB_SAMPLING_DEFAULTS = {"repetition_penalty": 1.05, "min_p": 0.05, "top_k": 20, "top_p": 0.8}
"""The test model's generation_config.json (Qwen2.5-Instruct's penalty and top-k/top-p, and a min_p)."""
LEASE_S = 6.0
"""The test server's pause lease: short, so the dead-trainer test waits little."""


def free_port() -> int:
    from stream_rl.common.ports import free_port as _free_port

    return _free_port()


@dataclass
class VLLMServer:
    workdir: Path
    url: str = ""
    model: Path = Path()
    proc: subprocess.Popen[bytes] | None = None
    error: str | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    started_s: float = 0.0

    @property
    def log(self) -> Path:
        return self.workdir / "vllm.log"

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def start_in_background(self) -> None:
        threading.Thread(target=self._start, name="vllm-test-server", daemon=True).start()

    def _start(self) -> None:
        t0 = time.monotonic()
        try:
            if not VLLM_PYTHON.exists():
                raise RuntimeError(f"{VLLM_PYTHON} is missing: run `make vllm` (make test does)")
            from models import cached_model

            from stream_rl.config import load_config
            from stream_rl.inference.launching import launch_for

            self.workdir.mkdir(parents=True, exist_ok=True)
            # The demo's model: a tiny Qwen2 warm-started on arithmetic (the e2e demo trains it).
            # Copied with a hub model's sampling defaults (as Qwen2.5-Instruct ships them): vLLM
            # must not apply them (the launcher's `--generation-config vllm`), or logprobs are not
            # log_softmax(logits / T) (tests/integration/test_vllm.py checks they are).
            self.model = self.workdir / "model"
            shutil.copytree(cached_model("tiny", warm_start="arithmetic"), self.model, dirs_exist_ok=True)
            generation = self.model / "generation_config.json"
            defaults = json.loads(generation.read_text()) if generation.exists() else {}
            generation.write_text(json.dumps({**defaults, **HUB_SAMPLING_DEFAULTS}))
            port = free_port()
            config = load_config(
                None,
                [
                    f"model.path={self.model}",
                    "inference.engine=vllm",
                    f"inference.base_port={port}",
                    f"inference.vllm.python={VLLM_PYTHON}",
                    "inference.vllm.max_model_len=512",
                    # The demo's batch (configs/demo-cpu.yaml): its 16 groups of 8 in one engine
                    # batch, not two (at vLLM's 64: the demo test's CPU 165 s -> 94 s, measured).
                    f"inference.max_batch={DEMO_BATCH}",
                    f"inference.vllm.pause_lease_s={LEASE_S}",
                    *(
                        [
                            "inference.device=cuda",
                            "inference.vllm.weight_transfer=stream_rl_gloo",
                            "inference.vllm.gpu_memory_utilization=0.3",
                            f"inference.vllm.extra_args={['--enforce-eager'] if VLLM_EAGER else []}",
                        ]
                        if VLLM_DEVICE == "cuda"
                        else []
                    ),
                ],
            )
            launch = launch_for(config, 0)
            env = {**os.environ, **launch.env, "STREAM_RL_ADMIN_TOKEN": TOKEN}
            with open(self.log, "wb") as log:
                self.proc = subprocess.Popen(
                    launch.cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            self.url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + launch.startup_timeout_s
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.tail()}")
                try:
                    if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                        self.started_s = time.monotonic() - t0
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            raise RuntimeError(f"vLLM not healthy after {launch.startup_timeout_s:.0f} s:\n{self.tail()}")
        except Exception as exc:  # noqa: BLE001 (reported by the fixture that waits)
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.ready.set()

    def wait(self, timeout_s: float = float(os.environ.get("STREAM_RL_VLLM_WAIT_S", "900"))) -> None:
        if not self.ready.wait(timeout_s):
            raise RuntimeError("the vLLM test server did not start in time")
        if self.error is not None:
            raise RuntimeError(self.error)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
