"""What a researcher looks at, on ONE short real run (`make demo` with a test config, shared by the
module): run identity (a second `make demo` refuses, a mismatched broker is one line), the
evaluator's eval-results against an independent transformers evaluation of the exported weights,
exports (model, rollouts), rescore, and the TensorBoard sink the launcher ran beside the stages
(`track.to`), read back. The W&B and MLflow sinks are in tests/integration/test_trackers.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from stream_rl.config import RunConfig, load_config
from stream_rl.contracts import EvalResult, ScoredRollout, WeightVersion, token_versions
from stream_rl.kafka.confluent import KafkaTransport
from stream_rl.kafka.reader import read_to_end
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.topics import EVAL_RESULTS, SCORED, TopicNames
from stream_rl.train.lineage import read_weight_versions

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TASK = {"max_operand": 9, "num_problems": 60, "eval_problems": 40}
MAX_STEPS = 4


@dataclass
class Run:
    name: str
    runs_dir: Path
    config_file: Path
    model: Path
    bootstrap: str
    output: str

    @property
    def dir(self) -> Path:
        return self.runs_dir / self.name

    @property
    def config(self) -> RunConfig:
        return load_config(self.dir / "config.yaml")


def free_port() -> int:
    from stream_rl.common.ports import free_port as fp

    return fp()


def make_demo(run: Run | None, config_file: Path, model: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "--no-print-directory", "demo", f"DEMO_CONFIG={config_file}", f"DEMO_MODEL={model}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true"},
    )


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stream_rl.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "WANDB_SILENT": "true"},
    )


@pytest.fixture(scope="module")
def research(tmp_path_factory: pytest.TempPathFactory, kafka_bootstrap: str) -> Run:
    import torch

    from stream_rl.inference.model_maker import make_model
    from stream_rl.tools.warm_start import warm_start

    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("research")
    model = make_model(tmp / "model", "tiny", seed=0)
    # A partly learned policy: greedy pass@1 strictly between 0 and 1 on the held-out split.
    warm_start(model, "arithmetic", TASK, steps=100, progress=False)  # measured: held-out greedy 18/40
    name = f"res{os.getpid()}"
    cfg = {
        "run": name,
        "runs_dir": str(tmp / "runs"),
        "model": {"path": str(model)},
        "kafka": {"bootstrap": kafka_bootstrap, "partitions": 2},
        "task": {"name": "arithmetic", "params": TASK},
        "actor": {"group_size": 4, "max_lag": 1, "sampling": {"max_tokens": 4}},
        "inference": {"num_servers": 1, "base_port": free_port(), "max_batch": 64},
        "trainer": {"samples_per_step": 16, "max_steps": MAX_STEPS, "bucket_mb": 1},
        "eval": {"every": 2, "samples": 2},
        "track": {"to": ["tensorboard"]},
        "launcher": {"max_wall_s": 300},
    }
    config_file = tmp / f"{name}.yaml"
    config_file.write_text(yaml.safe_dump(cfg))
    res = make_demo(None, config_file, model)
    assert res.returncode == 0, res.stdout + res.stderr
    return Run(name, tmp / "runs", config_file, model, kafka_bootstrap, res.stdout + res.stderr)


def topic_records(kafka: KafkaTransport, run: Run, topic: str, cls: Any) -> list[Any]:
    serde = default_serde()
    full = TopicNames(run=run.name)[topic]
    return [serde.decode(m.value, cls) for m in read_to_end(kafka, full, client_id="e2e-research")]


def evals(kafka: KafkaTransport, run: Run) -> list[EvalResult]:
    return topic_records(kafka, run, EVAL_RESULTS, EvalResult)


def versions(kafka: KafkaTransport, run: Run) -> dict[int, WeightVersion]:
    out: dict[int, WeightVersion] = {}
    for wv in read_weight_versions(kafka, TopicNames(run=run.name)):
        out.setdefault(wv.version, wv)
    return out


# -- evaluation ------------------------------------------------------------------------------------


def test_the_evaluator_publishes_one_exact_result_per_eval_every_versions(
    research: Run, kafka: KafkaTransport
) -> None:
    results = evals(kafka, research)
    assert [r.version for r in results] == [0, 2, 4]
    for r in results:
        assert r.num_problems == 40 and r.split == "held-out" and r.k == 2
        # eval.pin: the trainer held each next push, so every token came from the evaluated version.
        assert r.off_version_tokens == 0 and r.min_token_version == r.max_token_version == r.version
        assert r.pass_at_1 is not None and r.pass_at_k is not None and r.sampled_pass_at_1 is not None
        assert sum(r.verdicts.values()) == 40 * 3
    assert 0 < results[0].pass_at_1 < 1, "the warm start should leave room to learn"  # type: ignore[operator]
    summary = json.loads((research.dir / "summary.json").read_text())
    assert summary["eval"]["records"] == 3 and summary["eval"]["last"]["version"] == 4
    assert summary["eval"]["last"]["pass_at_1"] == results[-1].pass_at_1
    first, last = results[0], results[-1]
    assert (
        f"eval on held-out (version 0 -> 4): sampled pass@1 {first.sampled_pass_at_1:.3f} -> "
        f"{last.sampled_pass_at_1:.3f}, pass@2 {first.pass_at_k:.3f} -> {last.pass_at_k:.3f}, "
        f"greedy pass@1 {first.pass_at_1:.3f} -> {last.pass_at_1:.3f}"
    ) in research.output
    assert (research.dir / "plots" / "eval.png").stat().st_size > 5000
    status = cli("status", "--run", research.name, "--runs-dir", str(research.runs_dir), "--once",
                 "--bootstrap", research.bootstrap, timeout=60)  # fmt: skip
    assert status.returncode == 0, status.stderr
    assert (
        f"eval: version 4 on held-out (40 problems), sampled pass@1 {last.sampled_pass_at_1:.3f}"
        f" (T={last.temperature:g}), pass@2 {last.pass_at_k:.3f}, greedy pass@1 {last.pass_at_1:.3f}"
    ) in status.stdout


def greedy_correct(model_dir: Path, config: RunConfig) -> list[str]:
    """An independent evaluation: transformers' greedy generate on the held-out problems."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stream_rl.stages.evaluator import eval_problems
    from stream_rl.tasks import get_task

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    task = get_task(config.task.name, config.task.params)
    correct = []
    for problem in eval_problems(config):
        text = tok.apply_chat_template(
            [m.to_dict() for m in problem.prompt], add_generation_prompt=True, tokenize=False
        )
        ids = tok.encode(text, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=config.actor.sampling.max_tokens, do_sample=False,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
            )[0, len(ids):].tolist()  # fmt: skip
        finish = "stop" if tok.eos_token_id in out else "length"
        completion = tok.decode(out, skip_special_tokens=True)
        if task.score(problem, completion, finish_reason=finish).verdict.value == "correct":
            correct.append(problem.problem_id)
    return sorted(correct)


def behaviour_logprobs_match(model_dir: Path, rollouts: list[ScoredRollout]) -> int:
    """Teacher-forced logprobs (temperature 1) of the exported model equal the server's behaviour
    logprobs of tokens it sampled: the exported weights are the served ones. Returns tokens checked."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    checked = 0
    for s in rollouts:
        r = s.rollout
        ids = torch.tensor([r.prompt_token_ids + r.completion_token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(r.prompt_token_ids) - 1 : -1]
        lp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(r.completion_token_ids)[:, None])[
            :, 0
        ]
        assert lp.tolist() == pytest.approx(r.logprobs, abs=1e-4), r.rollout_id
        checked += len(r.completion_token_ids)
    return checked


def test_exported_models_reproduce_the_served_weights(
    research: Run, kafka: KafkaTransport, tmp_path: Path
) -> None:
    results = {r.version: r for r in evals(kafka, research)}
    lineage = versions(kafka, research)
    scored = topic_records(kafka, research, SCORED, ScoredRollout)
    config = research.config
    # 0: the base model; 2: rebuilt by re-training from version 0 (no checkpoint there); 4: the final checkpoint.
    from stream_rl.tools.export import export_model

    for version in (0, 2, MAX_STEPS):
        out = tmp_path / f"v{version}"
        if version == 0:  # the command once; the others in-process (same code, no interpreter start)
            res = cli("export", "model", "--run", research.name, "--runs-dir", str(research.runs_dir), "--version",
                      str(version), "--out", str(out), "--bootstrap", research.bootstrap)  # fmt: skip
            assert res.returncode == 0, res.stdout + res.stderr
            assert "matches weight-versions" in res.stdout
        else:
            export_model(config, kafka, out, version)
        record = json.loads((out / "stream-rl-export.json").read_text())
        assert record["checksum"] == lineage[version].checksum
        assert (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file()
        assert (
            "chat_template" in (out / "tokenizer_config.json").read_text()
            or (out / "chat_template.jinja").is_file()
        )
        if version in results:  # greedy output equals the server's, problem by problem
            assert greedy_correct(out, config) == results[version].greedy_correct, version
            assert len(results[version].greedy_correct) / 40 == results[version].pass_at_1
        at_v = [
            s
            for s in scored
            if set(token_versions(s.rollout.version_spans, len(s.rollout.completion_token_ids))) == {version}
        ]
        if version < MAX_STEPS:
            assert at_v, f"no rollout sampled wholly by version {version}"
            assert behaviour_logprobs_match(out, at_v[:8]) > 0


def test_export_rollouts_has_one_typed_row_per_scored_record(
    research: Run, kafka: KafkaTransport, tmp_path: Path
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = tmp_path / "rollouts.parquet"
    res = cli("export", "rollouts", "--run", research.name, "--runs-dir", str(research.runs_dir), "--out", str(out),
              "--bootstrap", research.bootstrap)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    scored = topic_records(kafka, research, SCORED, ScoredRollout)
    table = pq.read_table(out)
    assert table.num_rows == len(scored) > 0
    types = {f.name: f.type for f in table.schema}
    assert (
        types["reward"] == pa.float64() and types["version"] == pa.int64() and types["verdict"] == pa.string()
    )
    assert types["prompt_token_ids"] == pa.list_(pa.int32()) and types["logprobs"] == pa.list_(pa.float64())
    assert types["version_spans"] == pa.list_(pa.struct([("version", pa.int64()), ("start", pa.int32())]))
    rows = {r["rollout_id"]: r for r in table.to_pylist()}
    for s in scored[:20]:
        row = rows[s.rollout.rollout_id]
        assert row["reward"] == s.reward and row["logprobs"] == s.rollout.logprobs
        assert (
            row["completion_token_ids"] == s.rollout.completion_token_ids
            and row["verdict"] == s.verdict.value
        )
    import datasets

    ds = datasets.Dataset.from_parquet(str(out), cache_dir=str(tmp_path / "hf"))
    assert ds.num_rows == len(scored) and ds.features["reward"].dtype == "float64"


def test_rescore_writes_a_new_run_without_generating(research: Run, kafka: KafkaTransport) -> None:
    into = f"{research.name}-rescored"
    args = [
        "rescore",
        "--run",
        research.name,
        "--into",
        into,
        "--runs-dir",
        str(research.runs_dir),
        "--bootstrap",
        research.bootstrap,
    ]
    res = cli(*args)
    assert res.returncode == 0, res.stdout + res.stderr
    scored = topic_records(kafka, research, SCORED, ScoredRollout)
    rescored = topic_records(
        kafka,
        Run(into, research.runs_dir, research.config_file, research.model, "", ""),
        SCORED,
        ScoredRollout,
    )
    assert f"{len(scored)} rollouts re-scored, 0 changed" in res.stdout
    assert sorted((s.rollout.rollout_id, s.reward, s.verdict) for s in rescored) == sorted(
        (s.rollout.rollout_id, s.reward, s.verdict) for s in scored
    )
    assert all(s.verifier_id == "rescore" for s in rescored)
    assert load_config(research.runs_dir / into / "config.yaml").run == into
    again = cli(*args)
    assert (
        again.returncode == 2
        and again.stderr.strip().count("\n") == 0
        and "already has scored rollouts" in again.stderr
    )


# -- trackers --------------------------------------------------------------------------------------


def expected_metrics(kafka: KafkaTransport, run: Run) -> dict[str, dict[int, float]]:
    """Per metric name, {version: value} as the topics hold them."""
    out: dict[str, dict[int, float]] = {}
    for v, wv in versions(kafka, run).items():
        for key in ("reward_mean", "loss", "version_lag_mean", "samples_per_s"):
            if key in wv.metrics:
                out.setdefault(f"train/{key}", {})[v] = wv.metrics[key]
        out.setdefault("train/samples_trained", {})[v] = float(wv.samples_trained)
    for r in evals(kafka, run):
        out.setdefault("eval/held-out/pass_at_1", {})[r.version] = float(r.pass_at_1 or 0.0)
        out.setdefault("eval/held-out/pass_at_2", {})[r.version] = float(r.pass_at_k or 0.0)
    return out


def test_tensorboard_sink_followed_the_run_live(research: Run, kafka: KafkaTransport) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(research.dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    for name, want in expected_metrics(kafka, research).items():
        got = {e.step: e.value for e in acc.Scalars(name)}
        assert got == pytest.approx(want, rel=1e-6), name  # event files hold float32
    assert "config/text_summary" in acc.Tags()["tensors"]  # the resolved config, as text


# -- run identity ----------------------------------------------------------------------------------


def test_make_demo_again_refuses_and_a_mismatched_broker_is_one_line(research: Run) -> None:
    assert f"trained versions 0-{MAX_STEPS}" in research.output
    summary = (research.dir / "summary.json").read_bytes()
    again = make_demo(research, research.config_file, research.model)
    assert again.returncode != 0
    errors = [line for line in again.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"run {research.name} has finished ({MAX_STEPS} versions)" in errors[0], (
        again.stderr
    )
    assert str(research.dir / "summary.json") in errors[0] and "--set run=" in errors[0]
    assert "Traceback" not in again.stderr and "trained versions" not in again.stdout + again.stderr
    assert (research.dir / "summary.json").read_bytes() == summary
    # Another namespace on the broker: the run directory and the broker disagree.
    other = cli("run", str(research.config_file), "--set", "kafka.prefix=elsewhere", timeout=120)
    assert other.returncode == 2 and "Traceback" not in other.stderr
    (line,) = [x for x in other.stderr.splitlines() if x.startswith("error:")]
    assert "has no weight-versions for it" in line and "--set run=" in line
    listing = cli("runs", "--runs-dir", str(research.runs_dir), timeout=60)
    row = next(x for x in listing.stdout.splitlines() if x.startswith(research.name + " "))
    assert "finished" in row and f"{MAX_STEPS}/{MAX_STEPS}" in row
