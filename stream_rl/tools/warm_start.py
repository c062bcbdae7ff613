"""Supervised warm start on a task's format: `stream-rl make-model ... --warm-start arithmetic`.

This module holds the `make-model` command: the tiny model (`stream_rl.inference.model_maker`),
then, with `--warm-start TASK`, its warm start here.

RL needs a policy that already earns some reward (a base model). A random tiny model earns
none, so the demo first fits the task's ideal completions (`Task.format_example`) with a
cross-entropy loss **with label smoothing**: the model learns the answers (its greedy decode
is mostly right) but, with a share `label_smoothing` of every token's probability spread over
the vocabulary, sampling at temperature 1 gets whole answers right only a fraction of the time,
like a base model that knows the format but is noisy. RL then has something to sharpen; the
report gives the sampled and greedy accuracy so a user sees where RL starts.

Each task carries its defaults (`Task.warm_start`, measured per task); arguments override them.
AdamW at `lr` decays along a cosine to `min_lr_ratio` of it over the steps (the task's; 1.0,
constant, unless it says otherwise).
Short answers train in padded batches of `batch_size` examples; long, variable-length ones
(`batch_tokens` > 0) are packed into rows of about `ROW_TOKENS` tokens with positions restarting
at every example, so no step pays for padding to its longest example (transformers builds the
block-diagonal causal mask from the restarts, as in the trainer: `stream_rl/train/rows.py`).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from stream_rl.errors import TaskError
from stream_rl.inference.model_maker import PRESETS, count_parameters, make_model
from stream_rl.tasks import get_task
from stream_rl.tasks.base import Task

ROW_TOKENS = 1024
"""Row length of packed warm-start batches (a longer example gets a row of its own length)."""


@dataclass
class WarmStartReport:
    task: str
    steps: int
    seconds: float
    sampled_accuracy: float
    """Share of correct completions sampled at temperature 1 (what RL starts from)."""
    greedy_accuracy: float
    final_loss: float
    label_smoothing: float = 0.0

    def to_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


def _examples(task: Task, seed: int) -> list[tuple[list[dict[str, str]], str]]:
    fmt = getattr(task, "format_example", None)
    if fmt is None:
        raise TaskError(f"task {task.name!r} has no format_example(); it cannot be warm-started")
    problems = task.load_problems("warm-start", seed)
    return [([m.to_dict() for m in p.prompt], fmt(p)) for p in problems]


Encoded = tuple[list[int], int]
"""An example's token ids (prompt, answer, eos) and its prompt length."""


def _padded_batch(batch: list[Encoded], pad: int) -> tuple[Any, Any, Any, Any]:
    """(input_ids, attention_mask, None, targets): right-padded rows, one example each."""
    import torch

    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    target = torch.zeros((len(batch), width - 1))
    for i, (ids, plen) in enumerate(batch):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
        target[i, plen - 1 : len(ids) - 1] = 1.0  # the answer and its end-of-sequence token
    return input_ids, mask, None, target


def _packed_batch(batch: list[Encoded], pad: int) -> tuple[Any, Any, Any, Any]:
    """(input_ids, None, position_ids, targets): examples packed into rows, positions restarting
    at each (and at the padding), so each attends to itself only."""
    import torch

    from stream_rl.train.rows import assign_rows

    layout = assign_rows([len(ids) for ids, _ in batch], ROW_TOKENS)
    width = max(sum(len(batch[i][0]) for i in row) for row in layout)
    input_ids = torch.full((len(layout), width), pad)
    positions = torch.empty((len(layout), width), dtype=torch.long)
    target = torch.zeros((len(layout), width - 1))
    for r, row in enumerate(layout):
        col = 0
        for i in row:
            ids, plen = batch[i]
            input_ids[r, col : col + len(ids)] = torch.tensor(ids)
            positions[r, col : col + len(ids)] = torch.arange(len(ids))
            target[r, col + plen - 1 : col + len(ids) - 1] = 1.0
            col += len(ids)
        positions[r, col:] = torch.arange(width - col)
    return input_ids, None, positions, target


def _draw(encoded: list[Encoded], rng: random.Random, batch_size: int, batch_tokens: int) -> list[Encoded]:
    if not batch_tokens:
        return [encoded[rng.randrange(len(encoded))] for _ in range(batch_size)]
    batch: list[Encoded] = []
    tokens = 0
    while tokens < batch_tokens:
        example = encoded[rng.randrange(len(encoded))]
        batch.append(example)
        tokens += len(example[0])
    return batch


def warm_start(
    model_dir: str | Path,
    task_name: str = "arithmetic",
    task_params: dict[str, Any] | None = None,
    *,
    steps: int | None = None,
    batch_size: int | None = None,
    batch_tokens: int | None = None,
    lr: float | None = None,
    label_smoothing: float | None = None,
    seed: int = 0,
    eval_size: int = 256,
    progress: bool = True,
) -> WarmStartReport:
    """Fine-tune the model in `model_dir` in place on the task's ideal completions. Options left
    None take the task's defaults (`Task.warm_start`)."""
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    task = get_task(task_name, task_params or {})
    d = task.warm_start
    steps = d.steps if steps is None else steps
    batch_size = d.batch_size if batch_size is None else batch_size
    batch_tokens = d.batch_tokens if batch_tokens is None else batch_tokens
    lr = d.lr if lr is None else lr
    smoothing = d.label_smoothing if label_smoothing is None else label_smoothing
    examples = _examples(task, seed)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos

    def encode(messages: list[dict[str, str]], answer: str) -> Encoded:
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tok.encode(prompt, add_special_tokens=False)
        return ids + tok.encode(answer, add_special_tokens=False) + [eos], len(ids)

    encoded = [encode(m, a) for m, a in examples]
    longest_answer = max(len(ids) - plen for ids, plen in encoded)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    floor = d.min_lr_ratio
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(step / max(steps, 1), 1.0)))
    )
    model.train()
    started = time.monotonic()
    loss_value = float("nan")
    bar = tqdm(range(steps), desc=f"warm start ({task.name})", unit="step", disable=not progress)
    for _ in bar:
        batch = _draw(encoded, rng, batch_size, batch_tokens)
        build = _packed_batch if batch_tokens else _padded_batch
        input_ids, mask, positions, target = build(batch, pad)
        # use_cache=False: with a cache, transformers does not derive the block-diagonal mask of
        # packed rows from the position restarts (examples would attend to each other).
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=False)
        logits = out.logits[:, :-1]
        logp = F.log_softmax(logits, dim=-1)
        nll = -logp.gather(-1, input_ids[:, 1:, None])[..., 0]
        smooth = -logp.mean(dim=-1)
        per_token = (1 - smoothing) * nll + smoothing * smooth
        loss = (per_token * target).sum() / target.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
        loss_value = float(loss.detach())
        bar.set_postfix(loss=f"{loss_value:.3f}", refresh=False)
    model.eval()
    model.save_pretrained(model_dir)
    seconds = time.monotonic() - started
    sampled, greedy = evaluate(model_dir, task, eval_size, seed, max_tokens=longest_answer + 8)
    return WarmStartReport(task.name, steps, seconds, sampled, greedy, loss_value, smoothing)


def evaluate(
    model_dir: str | Path, task: Task, n: int, seed: int, *, max_tokens: int = 16
) -> tuple[float, float]:
    """(sampled accuracy at T=1, greedy accuracy) on `n` of the task's problems, with the engine
    (`max_tokens` per completion: leave room for the task's longest answer)."""
    from stream_rl.inference.engine import Engine
    from stream_rl.inference.requests import SamplingParams

    problems = task.load_problems("warm-start-eval", seed + 1)[:n]
    engine = Engine.load(model_dir)
    try:
        tok = engine.tokenizer
        prompts = [
            tok.encode(
                tok.apply_chat_template(
                    [m.to_dict() for m in p.prompt], add_generation_prompt=True, tokenize=False
                ),
                add_special_tokens=False,
            )
            for p in problems
        ]
        limit = min(max_tokens, engine.max_len - max(len(p) for p in prompts))
        out = []
        for temperature in (1.0, 0.0):
            params = SamplingParams(temperature=temperature, max_tokens=limit, seed=seed)
            results = engine.generate(prompts, params)
            correct = sum(
                task.score(p, r.sequences[0].text, finish_reason=r.sequences[0].finish_reason).verdict
                == "correct"
                for p, r in zip(problems, results, strict=True)
            )
            out.append(correct / max(len(problems), 1))
    finally:
        engine.stop()
    return out[0], out[1]


def add_make_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model size")
    parser.add_argument("--out", required=True, help="output directory (a Hugging Face model directory)")
    parser.add_argument("--arch", default="qwen2", choices=["qwen2", "llama"], help="architecture")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed")
    parser.add_argument("--overwrite", action="store_true", help="replace a model already in --out")
    parser.add_argument(
        "--untie-embeddings", action="store_true", help="give the lm_head its own weight (default: tied)"
    )
    ws = parser.add_argument_group(
        "warm start (supervised, on a task's format; see stream_rl/tools/warm_start.py)"
    )
    ws.add_argument(
        "--warm-start", metavar="TASK", default=None, help="fine-tune on TASK's ideal completions"
    )
    ws.add_argument(
        "--task-params", default="{}", help="the task's params as YAML/JSON, e.g. '{max_operand: 49}'"
    )
    ws.add_argument("--sft-steps", type=int, default=None, help="supervised steps (default: the task's)")
    ws.add_argument(
        "--sft-batch-tokens",
        type=int,
        default=None,
        help="tokens per step, examples packed into rows (0: 64 padded examples; default: the task's)",
    )
    ws.add_argument("--sft-lr", type=float, default=None, help="AdamW learning rate (default: the task's)")
    ws.add_argument(
        "--label-smoothing",
        type=float,
        default=None,
        help="probability share spread over the vocabulary: the higher, the noisier sampling "
        "(default: the task's, e.g. 0.35 for arithmetic, 0.02 for progression)",
    )


def main_make_model(args: argparse.Namespace) -> int:
    out = make_model(
        args.out,
        args.preset,
        seed=args.seed,
        arch=args.arch,
        overwrite=args.overwrite,
        tie_embeddings=not args.untie_embeddings,
    )
    print(f"wrote {args.arch} preset {args.preset} ({count_parameters(out):,} parameters) to {out}")
    if args.warm_start:
        params = yaml.safe_load(args.task_params) or {}
        report = warm_start(
            out,
            args.warm_start,
            params,
            steps=args.sft_steps,
            batch_tokens=args.sft_batch_tokens,
            lr=args.sft_lr,
            label_smoothing=args.label_smoothing,
            seed=args.seed,
        )
        (out / "warm_start.json").write_text(json.dumps(report.to_dict(), indent=2))
        print(
            f"warm start on {report.task}: {report.steps} steps in {report.seconds:.0f}s; accuracy sampled at "
            f"T=1 {report.sampled_accuracy:.2f}, greedy {report.greedy_accuracy:.2f} (RL starts from the former; "
            f"label smoothing {report.label_smoothing:g})"
        )
    return 0
