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
"""

from __future__ import annotations

import argparse
import json
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


@dataclass
class WarmStartReport:
    task: str
    steps: int
    seconds: float
    sampled_accuracy: float
    """Share of correct completions sampled at temperature 1 (what RL starts from)."""
    greedy_accuracy: float
    final_loss: float

    def to_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


def _examples(task: Task, seed: int) -> list[tuple[list[dict[str, str]], str]]:
    fmt = getattr(task, "format_example", None)
    if fmt is None:
        raise TaskError(f"task {task.name!r} has no format_example(); it cannot be warm-started")
    problems = task.load_problems("warm-start", seed)
    return [([m.to_dict() for m in p.prompt], fmt(p)) for p in problems]


def warm_start(
    model_dir: str | Path,
    task_name: str = "arithmetic",
    task_params: dict[str, Any] | None = None,
    *,
    steps: int = 800,
    batch_size: int = 64,
    lr: float = 1e-3,
    label_smoothing: float = 0.35,
    seed: int = 0,
    eval_size: int = 256,
    progress: bool = True,
) -> WarmStartReport:
    """Fine-tune the model in `model_dir` in place on the task's ideal completions."""
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    task = get_task(task_name, task_params or {})
    examples = _examples(task, seed)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos

    def encode(messages: list[dict[str, str]], answer: str) -> tuple[list[int], int]:
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tok.encode(prompt, add_special_tokens=False)
        return ids + tok.encode(answer, add_special_tokens=False) + [eos], len(ids)

    encoded = [encode(m, a) for m, a in examples]
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    started = time.monotonic()
    loss_value = float("nan")
    bar = tqdm(range(steps), desc=f"warm start ({task.name})", unit="step", disable=not progress)
    for _ in bar:
        batch = [encoded[rng.randrange(len(encoded))] for _ in range(batch_size)]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((batch_size, width), pad)
        mask = torch.zeros((batch_size, width), dtype=torch.long)
        target = torch.zeros((batch_size, width - 1))
        for i, (ids, plen) in enumerate(batch):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            mask[i, : len(ids)] = 1
            target[i, plen - 1 : len(ids) - 1] = 1.0  # the answer and its end-of-sequence token
        logits = model(input_ids=input_ids, attention_mask=mask).logits[:, :-1]
        logp = F.log_softmax(logits, dim=-1)
        nll = -logp.gather(-1, input_ids[:, 1:, None])[..., 0]
        smooth = -logp.mean(dim=-1)
        per_token = (1 - label_smoothing) * nll + label_smoothing * smooth
        loss = (per_token * target).sum() / target.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss_value = float(loss)
        bar.set_postfix(loss=f"{loss_value:.3f}", refresh=False)
    model.eval()
    model.save_pretrained(model_dir)
    seconds = time.monotonic() - started
    sampled, greedy = evaluate(model_dir, task, eval_size, seed)
    return WarmStartReport(task.name, steps, seconds, sampled, greedy, loss_value)


def evaluate(model_dir: str | Path, task: Task, n: int, seed: int) -> tuple[float, float]:
    """(sampled accuracy at T=1, greedy accuracy) on `n` of the task's problems, with the engine."""
    from stream_rl.inference.engine import Engine
    from stream_rl.inference.sequence import SamplingParams

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
        out = []
        for temperature in (1.0, 0.0):
            params = SamplingParams(temperature=temperature, max_tokens=16, seed=seed)
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
    ws = parser.add_argument_group("warm start (supervised, on a task's format; see stream_rl/warm_start.py)")
    ws.add_argument(
        "--warm-start", metavar="TASK", default=None, help="fine-tune on TASK's ideal completions"
    )
    ws.add_argument(
        "--task-params", default="{}", help="the task's params as YAML/JSON, e.g. '{max_operand: 49}'"
    )
    ws.add_argument("--sft-steps", type=int, default=800, help="supervised steps (batch 64)")
    ws.add_argument("--sft-lr", type=float, default=1e-3, help="AdamW learning rate")
    ws.add_argument(
        "--label-smoothing",
        type=float,
        default=0.35,
        help="probability share spread over the vocabulary: the higher, the noisier sampling",
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
            lr=args.sft_lr,
            label_smoothing=args.label_smoothing,
            seed=args.seed,
        )
        (out / "warm_start.json").write_text(json.dumps(report.to_dict(), indent=2))
        print(
            f"warm start on {report.task}: {report.steps} steps in {report.seconds:.0f}s; accuracy sampled at "
            f"T=1 {report.sampled_accuracy:.2f}, greedy {report.greedy_accuracy:.2f} (RL starts from the former)"
        )
    return 0
