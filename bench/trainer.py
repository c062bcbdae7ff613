"""Trainer step benchmark: tokens/s of stream-rl's RL step against plain transformers loss loops.

Same model, same micro-batches (synthetic rollouts: prompts of 8-16 tokens, completions of
4-64), same AdamW + clipping, one process, interleaved repeats:
- `stream-rl`: `PolicyTrainer` (samples packed into rows of `--row-tokens` with per-sample
  positions, logprobs at the sampling temperature on completion positions only, the
  truncated-IS policy loss);
- `hf packed`: the same packed rows through `model(input_ids, position_ids, labels)` (HF's
  causal-LM cross-entropy over completion labels): the like-for-like baseline;
- both again with one row per micro-batch (attention is quadratic in the row length);
- `hf padded`: the usual padded batch, `model(input_ids, attention_mask, labels)`: what
  packing saves.
Throughput is real (non-padding) tokens per CPU-second of this process, medians of interleaved
repeats (wall times are printed too; on a shared machine they swing with other load). Also reports the fraction of non-padding tokens of
the packing at several row lengths (goal >= 95%).

    python bench/trainer.py [--hidden 128 --layers 2] [--steps 4] [--threads 2]

Writes bench/results/trainer.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from stream_rl.config import TrainerConfig
from stream_rl.contracts import TrainingSample
from stream_rl.train.rows import pack_samples
from stream_rl.train.step import PolicyTrainer, configure_determinism, load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test builders (tests/fakes)

from fakes.training import make_sample, make_tiny_model  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "trainer.json"


def micro_batches(n: int, budget: int, vocab: int, seed: int) -> list[list[TrainingSample]]:
    """Micro-batches filled up to `budget` tokens, as the preprocessor packs them."""
    rng = random.Random(seed)
    out: list[list[TrainingSample]] = []
    for b in range(n):
        batch: list[TrainingSample] = []
        used = 0
        while True:
            s = make_sample(
                rng, key=f"b{b}.{len(batch)}", vocab_size=vocab, prompt_len=(8, 16), completion_len=(4, 64)
            )
            if used + len(s.input_ids) > budget:
                break
            batch.append(s)
            used += len(s.input_ids)
        out.append(batch)
    return out


def hf_step(
    model: Any, opt: torch.optim.Optimizer, batches: list[list[TrainingSample]], row_tokens: int | None
) -> None:
    """HF's causal-LM loss: on packed rows of `row_tokens` (as stream-rl packs), or padded (None)."""
    for samples in batches:
        if row_tokens is not None:
            p = pack_samples(samples, row_tokens)
            labels = torch.full_like(p.input_ids, -100)
            labels[p.rows, p.cols + 1] = p.labels
            out = model(input_ids=p.input_ids, position_ids=p.position_ids, labels=labels, use_cache=False)
        else:
            width = max(len(s.input_ids) for s in samples)
            ids = torch.zeros((len(samples), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            labels = torch.full_like(ids, -100)
            for i, s in enumerate(samples):
                n = len(s.input_ids)
                ids[i, :n] = torch.tensor(s.input_ids)
                mask[i, :n] = 1
                labels[i, s.prompt_len : n] = torch.tensor(s.input_ids[s.prompt_len :])
            out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def timed(fn: Callable[[], None]) -> tuple[float, float]:
    """(wall s, process CPU s) of one call. CPU time is what the comparison uses: on a shared
    machine other processes inflate wall time unevenly, not the CPU time this process spends."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step")
    ap.add_argument("--budget", type=int, default=4096, help="tokens per micro-batch (preprocessor default)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per variant (after one warm-up)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (trainer.torch_threads)")
    ap.add_argument("--row-tokens", type=int, default=512, help="packed row length (trainer.pack_row_tokens)")
    args = ap.parse_args()

    configure_determinism(False, seed=0, threads=args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="bench-trainer-"))
    heads = max(2, args.hidden // 32)
    path = make_tiny_model(
        tmp / "m",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        layers=args.layers,
        heads=heads,
        kv_heads=heads // 2 or 1,
    )
    batches = micro_batches(args.micro_batches, args.budget, args.vocab, seed=1)
    real = sum(len(s.input_ids) for b in batches for s in b)
    hf_model = load_model(path, "float32", "cpu")
    hf_opt = torch.optim.AdamW(hf_model.parameters(), lr=1e-4)  # the same as stream-rl's

    def ours(row_tokens: int) -> Callable[[], None]:
        cfg = TrainerConfig.model_validate({"lr": 1e-4, "pack_row_tokens": row_tokens})
        trainer = PolicyTrainer(load_model(path, "float32", "cpu"), cfg, temperature=1.0)

        def step() -> None:
            for b in batches:
                trainer.micro_batch(b)
            trainer.optimizer_step(sum(len(b) for b in batches))

        return step

    rows = args.row_tokens
    variants: dict[str, Callable[[], None]] = {
        "stream-rl": ours(rows),
        "hf packed": lambda: hf_step(hf_model, hf_opt, batches, rows),
        "stream-rl 1 row": ours(args.budget),
        "hf packed 1 row": lambda: hf_step(hf_model, hf_opt, batches, args.budget),
        "hf padded": lambda: hf_step(hf_model, hf_opt, batches, None),
    }
    wall: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():
        fn()  # warm-up
    for _ in range(args.steps):  # interleaved, so load changes hit every variant alike
        for name, fn in variants.items():
            w, c = timed(fn)
            wall[name].append(w)
            cpu[name].append(c)
    # tokens per CPU-second of this process (= per wall second on an idle machine with 1 thread)
    rate = {k: real / statistics.median(v) for k, v in cpu.items()}

    padded_fill = real / sum(len(b) * max(len(s.input_ids) for s in b) for b in batches)
    fill = {}
    for row in sorted({256, 512, args.row_tokens, args.budget}):
        packed = [pack_samples(b, row) for b in batches]
        fill[str(row)] = sum(p.real_tokens for p in packed) / sum(p.padded_tokens for p in packed)

    result = {
        "model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
                  "params": sum(p.numel() for p in hf_model.parameters())},
        "micro_batches_per_step": args.micro_batches,
        "tokens_per_step": real,
        "samples_per_step": sum(len(b) for b in batches),
        "threads": args.threads,
        "step_wall_s_median": {k: statistics.median(v) for k, v in wall.items()},
        "step_cpu_s_median": {k: statistics.median(v) for k, v in cpu.items()},
        "tokens_per_cpu_s": rate,
        "row_tokens": rows,
        "ratio_vs_hf_packed": rate["stream-rl"] / rate["hf packed"],
        "ratio_vs_hf_padded": rate["stream-rl"] / rate["hf padded"],
        "pack_fill_by_row_tokens": fill,
        "padded_batch_fill": padded_fill,
    }  # fmt: skip
    print(f"\nTrainer step, {result['model']['params'] / 1e6:.2f}M params, {real} tokens "
          f"({result['samples_per_step']} samples) per step in {args.micro_batches} micro-batches, "
          f"{args.threads} threads, median of {args.steps}\n")  # fmt: skip
    print(f"  {'variant':<16}  {'wall s':>7}  {'cpu s':>7}  {'tokens/cpu-s':>12}  {'vs stream-rl':>12}")
    for k in variants:
        w, c = statistics.median(wall[k]), statistics.median(cpu[k])
        print(f"  {k:<16}  {w:>7.3f}  {c:>7.3f}  {rate[k]:>12.0f}  {rate[k] / rate['stream-rl']:>11.2f}x")
    print("\n  non-padding fraction after packing (goal >= 0.95)")
    for row, f in fill.items():
        print(f"  rows of {row:>5} tokens: {f:.3f}")
    print(f"  padded batches (hf padded): {padded_fill:.3f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
