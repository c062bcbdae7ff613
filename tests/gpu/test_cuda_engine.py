"""The built-in engine on CUDA with in-flight weight updates (GPU only; `bench/gpu_check.sh`).

The server runs in this process (the real app and engine on cuda:0); the trainer is
`push_worker.py` in its own process, on the same GPU (gloo through host memory, or CUDA IPC) or,
with two GPUs, on the other one (NCCL). Checked per transport:
- an update in the middle of long generations lands (spans exact), and greedy decoding after it
  equals transformers' greedy decoding with the pushed weights (float32, so equal means equal);
- decoding keeps going during the receive: the longest gap between decode steps while the push
  runs, against the median step (recorded as a figure);
- a trainer killed halfway through an update does not hang decoding: the update fails within the
  server's deadline (NCCL: aborted), decoding never stopped, the server stays healthy, and a new
  trainer joins and pushes.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from cuda_helpers import DEVICE, TimedEngine, Worker, cuda_or_skip, longest_gap, record, transport_params
from fakes.server_thread import ServerThread, random_weights

from stream_rl.inference.model_maker import make_model
from stream_rl.inference.requests import SamplingParams

pytestmark = pytest.mark.gpu
TOKEN = "gpu-test"
PROMPTS = [[5, 9, 13, 2], [7, 7, 30, 31], [40, 41, 42, 43, 44, 45]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cuda_or_skip()
    # ~100M parameters (400 MB in float32): a transfer long enough to see decoding go on during it
    preset = "large" if DEVICE == "cuda" else "small"  # a CPU dry run only checks the plumbing
    return make_model(tmp_path_factory.mktemp("m") / preset, preset, seed=0)


@pytest.fixture
def server(model_dir: Path) -> Iterator[ServerThread]:
    engine = TimedEngine.load(model_dir, device=DEVICE, dtype="float32", max_batch=16, seed=0)
    with ServerThread(engine, admin_token=TOKEN, weights_timeout_s=10.0) as running:
        yield running


def worker_args(server: ServerThread, model_dir: Path, transport: str, *extra: str) -> list[str]:
    return [
        "--url", server.url, "--token", TOKEN, "--model", str(model_dir),
        "--dtype", "float32", "--transport", transport, "--timeout", "10", "--device", DEVICE, *extra,
    ]  # fmt: skip


def gpu_of(transport: str) -> int | None:
    return 1 if transport == "nccl" else None


def background_decoding(engine: Any, stop: threading.Event, tokens: int = 400) -> threading.Thread:
    """Keeps 8 long sequences decoding until `stop` (new ones as they finish)."""

    def run() -> None:
        params = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=1)
        while not stop.is_set():
            futures = [engine.submit([3 + i, 4, 5], params) for i in range(8)]
            for f in futures:
                f.result(timeout=300)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def hf_greedy(
    model_dir: Path, weights: list[tuple[str, torch.Tensor]], prompts: list[list[int]]
) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEVICE).eval()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in weights:
            params[name].copy_(tensor)
        out = []
        for prompt in prompts:
            ids = model.generate(
                torch.tensor([prompt], device=DEVICE), do_sample=False, max_new_tokens=16, min_new_tokens=16
            )
            out.append(ids[0, len(prompt) :].tolist())
    return out


@pytest.mark.parametrize("transport", transport_params())
def test_inflight_update_on_cuda(server: ServerThread, model_dir: Path, transport: str) -> None:
    engine: Any = server.engine
    stop = threading.Event()
    load = background_decoding(engine, stop)
    try:
        worker = Worker(
            *worker_args(server, model_dir, transport, "--versions", "1,2", "--delay-s", "1"),
            gpu=gpu_of(transport),
        )
        worker.wait_for("connected")  # the trainer is up: start a generation its pushes land in
        long_tokens = min(engine.max_len - 8, 1200)
        long = engine.submit(
            [9, 8, 7], SamplingParams(temperature=0.0, max_tokens=long_tokens, ignore_eos=True)
        )
        code, lines, err = worker.lines(timeout=180)
        assert code == 0, err
        lines = [line for line in lines if "report" in line]
        result = long.result(timeout=300)
    finally:
        stop.set()
        load.join(timeout=300)
    assert engine.version == 2
    spans = [(s.version, s.start) for s in result.sequences[0].version_spans]
    assert spans[0] == (0, 0) and {v for v, _ in spans} <= {0, 1, 2} and len(spans) >= 2
    steps = engine.step_times
    median = statistics.median(b - a for a, b in zip(steps, steps[1:], strict=False)) * 1000
    for line in lines:
        per = line["report"]["per_server"][server.url]
        gap, inside = longest_gap(steps, line["t_start"], line["t_end"])
        record(
            f"inflight_{transport}_v{line['version']}",
            {
                "push_ms": round((line["t_end"] - line["t_start"]) * 1000, 1),
                "receive_ms": round(per["receive_ms"], 1),
                "stall_ms": round(per["stall_ms"], 2),
                "longest_decode_gap_ms": round(gap, 1),
                "decode_steps_during_push": inside,
                "median_step_ms": round(median, 2),
            },
        )
        # Decoding went on during the receive: steps ran inside the push, and no gap came
        # near the receive's own length (a default-stream wait would make it as long).
        if DEVICE == "cuda" and per["receive_ms"] > 50:
            assert inside >= 3, (inside, per)
            assert gap < 0.5 * per["receive_ms"] + 20, (gap, per)
    # Greedy after the updates equals transformers with the pushed weights (version 2's).
    weights = [(n, t.to(DEVICE)) for n, t in random_weights(engine.model, 100 + 2)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    got = [r.sequences[0].token_ids for r in (engine.submit(p, params).result(timeout=60) for p in PROMPTS)]
    assert got == hf_greedy(model_dir, weights, PROMPTS)


@pytest.mark.parametrize("transport", transport_params())
def test_a_trainer_dead_mid_update_does_not_hang_decoding(
    server: ServerThread, model_dir: Path, transport: str
) -> None:
    engine: Any = server.engine
    stop = threading.Event()
    load = background_decoding(engine, stop)
    try:
        time.sleep(1.0)
        dead = Worker(*worker_args(server, model_dir, transport, "--die-mid-push"), gpu=gpu_of(transport))
        dead.wait_for("connected")
        t_start = time.time()
        code, _, err = dead.lines(timeout=120)
        assert code == 3, err  # it died on purpose, mid-update
        # The server gives up on that update within its deadline (10 s), decoding all along.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not _update_failed(server):
            time.sleep(0.1)
        t_end = time.time()
        assert _update_failed(server) or transport == "cuda_ipc", "the broken update never ended"
        gap, inside = longest_gap(engine.step_times, t_start, t_end)
        record(f"dead_trainer_{transport}", {"longest_decode_gap_ms": round(gap, 1), "steps": inside})
        assert gap < 2000 or DEVICE != "cuda", gap  # never stuck behind the dead collective
        assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
        # A new trainer joins and pushes.
        fresh = Worker(*worker_args(server, model_dir, transport, "--versions", "5"), gpu=gpu_of(transport))
        code, lines, err = fresh.lines(timeout=180)
        assert code == 0, err
        lines = [line for line in lines if "report" in line]
        assert lines[-1]["report"]["updated"] == [server.url] and engine.version == 5
    finally:
        stop.set()
        load.join(timeout=300)


def _update_failed(server: ServerThread) -> bool:
    text = httpx.get(f"{server.url}/metrics").text
    return any(
        line.startswith("stream_rl_inference_weight_updates_total") and 'outcome="failed"' in line
        and float(line.rsplit(" ", 1)[1]) >= 1
        for line in text.splitlines()
    )  # fmt: skip
