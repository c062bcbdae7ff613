"""Decode-step time against batch occupancy, built-in engine on CPU, both decode shapes
(`inference.decode_shape`): `running` (the model runs over the running sequences: on a CPU a
step costs in proportion to them) and `fixed` (every slot, idle ones padded: a step costs the same
at any occupancy, the cost curve of a memory-bound accelerator, emulated).

Per shape and occupancy k (1 .. max_batch), k sequences are admitted and decoded for
`--steps` steps after a warm-up; the figure is the median step time over `--repeats` rounds,
shapes and occupancies interleaved in each round (the machine is shared and noisy). Prints a
table, writes bench/results/decode_shape.json and a plot (step time against occupancy) beside it.

    .venv/bin/python bench/decode_shape.py [--preset small] [--max-batch 32] [--steps 16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from stream_rl.inference.batch import DECODE_SHAPES
from stream_rl.inference.engine import Engine
from stream_rl.inference.model_maker import make_model
from stream_rl.inference.requests import SamplingParams

RESULTS = Path(__file__).parent / "results" / "decode_shape.json"
PROMPT = [4, 57, 61, 49, 58, 59, 67, 1, 5, 50, 51, 52, 53, 54, 55, 56]


def occupancies(max_batch: int) -> list[int]:
    points, k = [], 1
    while k < max_batch:
        points.append(k)
        k *= 2
    return [*points, max_batch]


def step_ms(engine: Engine, occupancy: int, steps: int, seeded: bool = True) -> float:
    """Median decode-step time (ms) with `occupancy` sequences running (each request seeded, or
    all drawing from the engine's shared generator: `actor.seeded_sampling: false`)."""
    seed = 0 if seeded else None
    params = SamplingParams(temperature=1.0, max_tokens=steps + 4, seed=seed, ignore_eos=True)
    futures = [engine.submit(PROMPT, params) for _ in range(occupancy)]
    times = []
    with torch.inference_mode():
        while engine.stats().running < occupancy:  # admission (the prefill) first
            engine.step()
        engine.step()  # warm-up
        for _ in range(steps):
            assert engine.stats().running == occupancy
            start = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - start) * 1000.0)
        while not all(f.done() for f in futures):
            engine.step()
    return statistics.median(times)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for shape, rows in results["shapes"].items():
        ks = [r["occupancy"] for r in rows]
        med = [r["step_ms"]["median"] for r in rows]
        lo = [r["step_ms"]["median"] - r["step_ms"]["min"] for r in rows]
        hi = [r["step_ms"]["max"] - r["step_ms"]["median"] for r in rows]
        ax.errorbar(ks, med, yerr=[lo, hi], marker="o", capsize=3, label=f"decode_shape: {shape}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"running sequences (of max_batch {results['max_batch']})")
    ax.set_ylabel("decode step (ms), median of rounds, min-max")
    ax.set_ylim(bottom=0)
    draws = "seeded requests" if results.get("seeded", True) else "unseeded requests"
    ax.set_title(f"built-in engine, CPU, preset {results['preset']} ({draws}):\nstep time against occupancy")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a server's default: 1)")
    parser.add_argument(
        "--unseeded",
        action="store_true",
        help="requests without a seed (the engine's shared generator: one draw per step for the batch)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = make_model(Path(tempfile.mkdtemp(prefix="decode-shape-")) / args.preset, args.preset, seed=0)
    engines = {
        shape: Engine.load(model_dir, max_batch=args.max_batch, seed=0, decode_shape=shape)
        for shape in DECODE_SHAPES
    }
    points = occupancies(args.max_batch)
    samples: dict[str, dict[int, list[float]]] = {s: {k: [] for k in points} for s in DECODE_SHAPES}
    for round_ in range(args.repeats):
        order = points if round_ % 2 == 0 else points[::-1]
        for k in order:
            for shape in DECODE_SHAPES if (round_ + k) % 2 == 0 else DECODE_SHAPES[::-1]:
                samples[shape][k].append(step_ms(engines[shape], k, args.steps, seeded=not args.unseeded))
        print(f"round {round_ + 1}/{args.repeats} done", flush=True)
    results: dict[str, Any] = {
        "preset": args.preset,
        "max_batch": args.max_batch,
        "steps": args.steps,
        "repeats": args.repeats,
        "threads": args.threads,
        "seeded": not args.unseeded,
        "shapes": {
            shape: [
                {
                    "occupancy": k,
                    "step_ms": {
                        "median": statistics.median(v),
                        "min": min(v),
                        "max": max(v),
                        "all": v,
                    },
                }
                for k, v in by_k.items()
            ]
            for shape, by_k in samples.items()
        },
    }
    print(f"\npreset {args.preset}, max_batch {args.max_batch}: decode step (ms), median of {args.repeats}")
    print(f"{'running':>8} " + " ".join(f"{s:>22}" for s in DECODE_SHAPES) + f" {'fixed/running':>14}")
    for i, k in enumerate(points):
        cells = [results["shapes"][s][i]["step_ms"] for s in DECODE_SHAPES]
        text = " ".join(f"{c['median']:8.2f} ({c['min']:5.2f}-{c['max']:5.2f})" for c in cells)
        print(f"{k:>8} {text} {cells[1]['median'] / cells[0]['median']:14.2f}")
    for shape in DECODE_SHAPES:
        med = [r["step_ms"]["median"] for r in results["shapes"][shape]]
        spread = (max(med) - min(med)) / statistics.median(med)
        results[f"{shape}_spread"] = spread
        print(f"{shape}: (max - min) / median over occupancies = {spread:.1%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    png = args.out.with_suffix(".png")
    plot(results, png)
    print(f"wrote {args.out} and {png}")
    for engine in engines.values():
        engine.stop()


if __name__ == "__main__":
    main()
