"""Engine tokens/s versus transformers' static-batch `generate()` on the same model and workload.

Both sides get the same prompts and the same per-request max_tokens, sample at temperature 1
from the full distribution (top_k=0, top_p=1) and ignore eos, so the useful work is exactly
sum(max_tokens). `generate()` runs the requests in arrival order in static batches of
`--batch` (left-padded, each batch decoding to its longest max_tokens; tokens past a request's
max_tokens are wasted); the engine keeps up to `--batch` sequences running and refills slots as
requests finish. Workloads: `mixed` (prompt and completion lengths vary, 8-128 tokens),
`uniform` (every request alike: measures per-step overhead alone) and `long` (the long task's
completion lengths: `progression`'s seed-0 draw, 16 to 1,024 tokens, median 84, behind its
28-token chat prompts; static batches then wait for their longest request).

    .venv/bin/python bench/engine_throughput.py [--model DIR] [--requests 256] [--repeats 3]
    .venv/bin/python bench/engine_throughput.py --workloads long --requests 128    # README
    python bench/engine_throughput.py --device cuda --dtype bfloat16 --preset large   # a GPU

Prints a table and writes bench/results/engine_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

from stream_rl.inference.engine import Engine
from stream_rl.inference.model_maker import make_model
from stream_rl.inference.requests import SamplingParams

RESULTS = Path(__file__).parent / "results" / "engine_throughput.json"


def long_lengths(requests: int) -> list[int]:
    """Completion tokens of the long task's first `requests` problems (seed 0)."""
    from stream_rl.tasks import get_task

    problems = get_task("progression", {"num_problems": requests}).load_problems("bench", 0)
    return [len(p.answer or "") + 1 for p in problems]


def workload(kind: str, requests: int, vocab: tuple[int, int], seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    if kind == "long":
        return [([rng.randrange(*vocab) for _ in range(28)], n) for n in long_lengths(requests)]
    out = []
    for _ in range(requests):
        if kind == "mixed":
            plen, max_tokens = rng.randint(8, 40), rng.randint(8, 128)
        else:
            plen, max_tokens = 12, 32
        out.append(([rng.randrange(*vocab) for _ in range(plen)], max_tokens))
    return out


def run_static(engine: Engine, work: list[tuple[list[int], int]], batch: int) -> float:
    model, pad = engine.model, engine.tokenizer.pad_token_id
    config = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad, eos_token_id=None
    )
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(work), batch):
            chunk = work[i : i + batch]
            longest = max(len(p) for p, _ in chunk)
            ids = torch.full((len(chunk), longest), pad, dtype=torch.long, device=engine.device)
            mask = torch.zeros_like(ids)
            for row, (prompt, _) in enumerate(chunk):
                ids[row, longest - len(prompt) :] = torch.tensor(prompt, device=engine.device)
                mask[row, longest - len(prompt) :] = 1
            new = max(m for _, m in chunk)
            out = model.generate(
                ids, attention_mask=mask, generation_config=config, max_new_tokens=new, min_new_tokens=new
            )
            assert out.shape[1] == longest + new
    if engine.device.type == "cuda":
        torch.cuda.synchronize()  # the last batch's kernels are part of its time
    return time.perf_counter() - start


def run_engine(engine: Engine, work: list[tuple[list[int], int]]) -> float:
    start = time.perf_counter()
    futures = [
        engine.submit(p, SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True)) for p, m in work
    ]
    results = [f.result() for f in futures]
    elapsed = time.perf_counter() - start
    assert [len(r.sequences[0].token_ids) for r in results] == [m for _, m in work]
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model directory (default: a fresh tiny preset)")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--workloads", default="mixed,uniform,long", help="comma-separated: mixed, uniform, long"
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--out", default=None, help="results file (default bench/results/engine_throughput.json)"
    )
    parser.add_argument("--name", default=None, help="bench/results/<name>.json (instead of --out)")
    args = parser.parse_args()
    kinds = [k.strip() for k in args.workloads.split(",") if k.strip()]
    if unknown := set(kinds) - {"mixed", "uniform", "long"}:
        parser.error(f"unknown workload(s) {sorted(unknown)}")
    if args.out and args.name:
        parser.error("--out and --name are alternatives")
    results = Path(args.out) if args.out else RESULTS.with_name(f"{args.name or RESULTS.stem}.json")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or make_model(Path(tmp) / args.preset, args.preset)
        engine = Engine.load(path, device=args.device, dtype=args.dtype, max_batch=args.batch, seed=0).start()
        vocab = (6, 6 + 95)  # printable bytes of the preset tokenizer; any ids work for a random model
        rows = []
        for kind in kinds:
            work = workload(kind, args.requests, vocab, seed=0)
            useful = sum(m for _, m in work)
            run_static(engine, work[: args.batch // 4], args.batch)  # warm-up
            run_engine(engine, work[: args.batch // 4])
            static_s, engine_s = [], []
            for _ in range(args.repeats):  # interleaved so machine noise hits both sides alike
                static_s.append(run_static(engine, work, args.batch))
                engine_s.append(run_engine(engine, work))
            static_tps, engine_tps = (
                useful / statistics.median(static_s),
                useful / statistics.median(engine_s),
            )
            rows.append(
                {
                    "workload": kind,
                    "requests": args.requests,
                    "useful_tokens": useful,
                    "static_generate_tokens_per_s": round(static_tps),
                    "engine_tokens_per_s": round(engine_tps),
                    "ratio": round(engine_tps / static_tps, 2),
                    "max_tokens": {
                        "median": statistics.median(m for _, m in work),
                        "max": max(m for _, m in work),
                    },
                    "static_s": [round(s, 3) for s in static_s],
                    "engine_s": [round(s, 3) for s in engine_s],
                }
            )
        engine.stop()
    meta = {
        "model": str(args.model or f"preset {args.preset}"),
        "batch": args.batch,
        "threads": args.threads,
        "device": args.device,
        "dtype": args.dtype,
    }
    print(
        f"engine vs static generate(), batch {args.batch}, {args.threads} thread(s), median of {args.repeats}"
    )
    print("| workload | requests | useful tokens | generate() tok/s | engine tok/s | ratio |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['workload']} | {r['requests']} | {r['useful_tokens']} | {r['static_generate_tokens_per_s']} "
            f"| {r['engine_tokens_per_s']} | {r['ratio']}x |"
        )
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps({**meta, "results": rows}, indent=2) + "\n")
    print(f"wrote {results}")


if __name__ == "__main__":
    main()
