"""Every GPU check of the built-in engine in one run, one results file (`bench/gpu_check.sh` calls it).

Steps, each in its own process session with a time limit (killed with its whole group after, so
nothing is left running):
1. environment: Python, torch, transformers, the GPUs, and that every module the checks import
   imports (the wheels carried in `.whl/` are installed first by the shell script);
2. NCCL on one GPU: two ranks on GPU 0 try to form a group (the reason the colocated path
   exists; expected to fail with "Duplicate GPU detected");
3. `pytest -m gpu tests/gpu` (junit XML parsed: every test's outcome and skip reason; the vLLM
   and SGLang adapter tests skip for the absent packages);
4. `bench/engine_throughput.py --device cuda` (engine vs static generate());
5. `bench/gpu_weight_sync.py` (bandwidth and decode stall per transport).

    python bench/gpu_check.py --out $OUT/gpu_check.json

Exit status 0 only if every step passed (pytest: no failure or error).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODULES = [
    "torch", "transformers", "tokenizers", "safetensors", "pydantic", "fastapi", "starlette", "uvicorn",
    "httpx", "yaml", "fastavro", "prometheus_client", "numpy", "pytest", "stream_rl.inference.server",
    "stream_rl.train.step", "stream_rl.weights.sender_choice", "stream_rl.weights.ipc_sender",
]  # fmt: skip

NCCL_PROBE = r"""
import os, sys, torch, torch.distributed as dist
from datetime import timedelta
rank = int(sys.argv[1]); port = int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
pg = dist.ProcessGroupNCCL(store, rank, 2, dist.ProcessGroupNCCL.Options())
t = torch.ones(1, device="cuda:0")
try:
    pg.broadcast([t], dist.BroadcastOptions()).wait()
    torch.cuda.synchronize()
    print("FORMED")
except Exception as exc:
    print("REFUSED", type(exc).__name__, str(exc).splitlines()[0][:300])
"""


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `cmd` in its own session; kill the whole group at the end whatever happened."""
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env or os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # children it left behind
    print(out[-6000:], flush=True)
    return {
        "cmd": " ".join(cmd),
        "rc": proc.returncode,
        "timed_out": timed_out,
        "seconds": round(time.monotonic() - start, 1),
        "tail": out[-4000:],
    }


def environment() -> dict[str, Any]:
    import importlib

    info: dict[str, Any] = {"python": platform.python_version(), "imports": {}}
    for name in MODULES:
        try:
            module = importlib.import_module(name)
            info["imports"][name] = getattr(module, "__version__", "ok")
        except Exception as exc:  # noqa: BLE001 - a report of what is missing, whatever it is
            info["imports"][name] = f"FAILED: {type(exc).__name__}: {exc}"
    import torch

    info["cuda"] = torch.cuda.is_available()
    info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    info["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    info["ok"] = info["cuda"] and not any(str(v).startswith("FAILED") for v in info["imports"].values())
    return info


def nccl_probe() -> dict[str, Any]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(NCCL_PROBE)
    procs = [
        subprocess.Popen([sys.executable, f.name, str(r), str(port)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for r in (0, 1)
    ]  # fmt: skip
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=60)[0])
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            outs.append("TIMEOUT " + (p.communicate()[0] or ""))
    verdicts = [
        next((ln for ln in o.splitlines() if ln.startswith(("FORMED", "REFUSED"))), o[-300:]) for o in outs
    ]
    return {"two_ranks_on_gpu0": verdicts, "formed": all(v.startswith("FORMED") for v in verdicts)}


def pytest_results(xml_path: Path) -> dict[str, Any]:
    if not xml_path.exists():
        return {"tests": [], "failed": ["(no junit report)"]}
    tests, failed = [], []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome, detail = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                detail = (node.get("message") or "")[:500]
        if outcome in ("failed", "error"):
            failed.append(name)
        tests.append(
            {"test": name, "outcome": outcome, "seconds": float(case.get("time") or 0), "detail": detail}
        )
    return {"tests": tests, "failed": failed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--skip-bench", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "steps": {}}
    failures: list[str] = []
    started = time.monotonic()

    def save() -> None:
        results["seconds"] = round(time.monotonic() - started, 1)
        results["failures"] = failures
        out.write_text(json.dumps(results, indent=2) + "\n")

    results["environment"] = env = environment()
    print(json.dumps(env, indent=2), flush=True)
    if not env["ok"]:
        failures.append("environment")
        save()
        return 1
    results["nccl_one_gpu"] = nccl_probe()
    print("NCCL, two ranks on one GPU:", results["nccl_one_gpu"], flush=True)

    figures = work / "figures.jsonl"
    xml = work / "pytest.xml"
    test_env = dict(os.environ, STREAM_RL_GPU_FIGURES=str(figures), PYTHONUNBUFFERED="1")
    step = run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-v", "-rs", "-p", "no:cacheprovider",
         f"--junitxml={xml}", "--timeout=240"],
        timeout=330, env=test_env,
    )  # fmt: skip
    step.update(pytest_results(xml))
    if figures.exists():
        step["figures"] = [json.loads(line) for line in figures.read_text().splitlines() if line]
    results["steps"]["pytest_gpu"] = step
    if step["rc"] != 0 or step["failed"]:
        failures.append("pytest_gpu")
    skipped = [t for t in step["tests"] if t["outcome"] == "skipped"]
    for t in skipped:
        print(f"SKIPPED {t['test']}: {t['detail']}", flush=True)
    results["steps"]["pytest_gpu"]["note"] = (
        "vLLM/SGLang adapter tests skip: those packages are not installed on this machine (honest for "
        "an absent package); nccl cases skip on one GPU (NCCL refuses two ranks on one GPU)"
    )
    save()

    if not args.skip_bench:
        engine_json = work / "engine_throughput.json"
        step = run(
            [sys.executable, "bench/engine_throughput.py", "--device", "cuda", "--dtype", "bfloat16",
             "--preset", "large", "--requests", "256", "--batch", "64", "--repeats", "3", "--threads", "4",
             "--out", str(engine_json)],
            timeout=200,
        )  # fmt: skip
        if engine_json.exists():
            step["results"] = json.loads(engine_json.read_text())
        results["steps"]["bench_engine_throughput"] = step
        if step["rc"] != 0:
            failures.append("bench_engine_throughput")
        save()
        sync_json = work / "gpu_weight_sync.json"
        step = run([sys.executable, "bench/gpu_weight_sync.py", "--out", str(sync_json)], timeout=200)
        if sync_json.exists():
            step["results"] = json.loads(sync_json.read_text())
        results["steps"]["bench_weight_sync"] = step
        if step["rc"] != 0:
            failures.append("bench_weight_sync")
    save()
    print(f"wrote {out}; failures: {failures or 'none'}; {results['seconds']} s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
