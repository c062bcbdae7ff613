"""loader -> actor -> verifier -> preprocessor on a real broker, each test twice: with fake inference
servers (a known policy, so exact expectations) and with the real tiny inference server (one per
module, in a thread); and the admission tests with a fake trainer that publishes weight versions."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from fakes.inference import END, FakeServer, arithmetic_reply, factory, render
from fakes.records import f32
from fakes.trainer import FakeTrainer
from stage_helpers import StageThread, make_config, publish_version, read, wait_for

from stream_rl.contracts import Problem, ScoredRollout, TrainingBatch, TrainingSample, Verdict
from stream_rl.kafka.confluent import KafkaTransport
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.topics import PROBLEMS, SCORED, TRAINING_BATCHES, TopicNames
from stream_rl.rl.advantages import compute_advantages
from stream_rl.stages import actor, loader, preprocessor, verifier
from stream_rl.stages.rollouts import ChatTokenizer, sample_seed
from stream_rl.tasks import get_task

pytestmark = pytest.mark.integration
serde = default_serde()


@dataclass
class Inference:
    kind: str
    urls: list[str]
    client_factory: Callable[[str], Any] | None
    set_version: Callable[[int], None]
    model_path: str = "models/unused"


@pytest.fixture(scope="module")
def real_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    import torch
    from fakes.server_thread import ServerThread

    from stream_rl.inference.engine import Engine
    from stream_rl.inference.model_maker import make_model

    torch.set_num_threads(1)
    path = make_model(tmp_path_factory.mktemp("model") / "tiny", "tiny", seed=0)
    engine = Engine.load(path, seed=0)
    with ServerThread(engine) as server:
        server.model_path = str(path)
        yield server


@pytest.fixture(params=["fake", "real"])
def inference(request: pytest.FixtureRequest) -> Inference:
    if request.param == "fake":
        servers = [FakeServer("http://fake-a"), FakeServer("http://fake-b")]

        def bump(v: int) -> None:
            for s in servers:
                s.version = v

        return Inference("fake", [s.url for s in servers], factory(servers), bump)
    server = request.getfixturevalue("real_server")
    engine = server.engine

    def install(v: int) -> None:
        # The real trainer broadcasts new weights; the same tensors under a new version suffice here.
        same = {
            engine.parameters.canonical(n): p.detach().clone() for n, p in engine.model.named_parameters()
        }
        engine.swap_weights(v, same).result(timeout=60)

    install(0)  # the server outlives the test: each run starts at version 0
    return Inference("real", [server.url], None, install, server.model_path)


def pipeline_config(names: TopicNames, bootstrap: str, inf: Inference, **sections: Any):  # type: ignore[no-untyped-def]
    base: dict[str, Any] = {
        "inference": {"servers": [{"url": u} for u in inf.urls]},
        "model": {"path": inf.model_path},
    }
    base["actor"] = {"sampling": {"max_tokens": 6, "temperature": 1.0}, **sections.pop("actor", {})}
    base["actor"] = {"group_size": 4, "max_lag": 1, "backoff_s": 0.01, "refresh_s": 0.5, **base["actor"]}
    return make_config(names, bootstrap, **base, **sections)


def test_stages_turn_problems_into_the_right_training_batches(
    kafka: KafkaTransport, run_names: TopicNames, kafka_bootstrap: str, inference: Inference
) -> None:
    config = pipeline_config(
        run_names,
        kafka_bootstrap,
        inference,
        task={"name": "arithmetic", "params": {"num_problems": 6, "max_operand": 9}},
    )
    g, n = 4, 6
    publish_version(kafka, run_names, 0)
    assert loader.run(config).records_out == n
    a = actor.run(config, client_factory=inference.client_factory, max_records=n, idle_timeout_s=30)
    v = verifier.run(config, max_records=n * g, idle_timeout_s=30)
    p = preprocessor.run(config, max_records=n * g, idle_timeout_s=30)
    assert (a.records_out, v.records_out, p.extra["emitted"]) == (n * g, n * g, n)
    batches = [serde.decode(m.value, TrainingBatch) for m in read(kafka, run_names[TRAINING_BATCHES])]
    samples = [s for b in batches for s in b.samples]
    assert len(samples) == n * g and len({s.rollout_id for s in samples}) == n * g
    problems = {
        p.problem_id: p for p in (serde.decode(m.value, Problem) for m in read(kafka, run_names[PROBLEMS]))
    }
    task = get_task("arithmetic", {"num_problems": 6, "max_operand": 9})
    scored = {
        x.rollout.rollout_id: x
        for x in (serde.decode(m.value, ScoredRollout) for m in read(kafka, run_names[SCORED]))
    }
    tokenizer = None if inference.kind == "fake" else ChatTokenizer(inference.model_path)
    groups: dict[str, list[TrainingSample]] = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s)
    assert len(groups) == n and all(len(v) == g for v in groups.values())
    for gid, members in groups.items():
        members.sort(key=lambda s: s.rollout_id)
        problem = problems[gid.rsplit(".e", 1)[0]]
        for s in members:
            completion = s.input_ids[s.prompt_len :]
            rollout = scored[s.rollout_id].rollout
            assert s.loss_mask == [True] * len(completion)  # every sampled token, EOS included
            assert len(s.behaviour_logprobs) == len(completion) and all(
                lp <= 0 for lp in s.behaviour_logprobs
            )
            assert s.behaviour_logprobs == rollout.logprobs and [sp.version for sp in s.version_spans] == [0]
            # The reward is the task's verdict on the completion's text.
            assert s.reward == task.score(problem, rollout.text, finish_reason=rollout.finish_reason).reward
            assert s.reward == scored[s.rollout_id].reward and s.verdict == scored[s.rollout_id].verdict
            if tokenizer is None:
                # The fake policy is known: right unless the sequence's seed is a multiple of 3
                # (one request per group; sequence i's seed derives from the group's).
                index = int(s.rollout_id.rsplit(".s", 1)[1])
                expected = arithmetic_reply(
                    problem.prompt[-1].content, sample_seed(config.seed, gid) * 1_000_003 + index
                )
                assert completion == [*map(ord, expected), END] and rollout.text == expected
                assert s.input_ids[: s.prompt_len] == render([m.to_dict() for m in problem.prompt])
                assert s.reward == (1.0 if expected == problem.answer else 0.0)
            else:
                assert s.input_ids[: s.prompt_len] == tokenizer.render(problem.prompt)
                assert tokenizer.decode(completion) == rollout.text
                assert len(completion) <= 6 and (rollout.finish_reason == "length" or len(completion) >= 1)
        rewards = [s.reward for s in members]
        for s, adv in zip(members, compute_advantages(rewards), strict=True):
            assert s.advantages == [f32(adv)] * len(s.advantages)
    verdicts = Counter(s.verdict for s in samples)
    assert set(verdicts) <= {Verdict.CORRECT, Verdict.WRONG, Verdict.NO_ANSWER, Verdict.UNPARSABLE}


def run_with_trainer(
    kafka: KafkaTransport, names: TopicNames, bootstrap: str, inf: Inference, mode: str, steps: int
) -> FakeTrainer:
    S = 8
    config = pipeline_config(
        names,
        bootstrap,
        inf,
        mode=mode,
        task={"name": "arithmetic", "params": {"num_problems": 40}},
        actor={"max_lag": 1},
        trainer={"samples_per_step": S},
        preprocessor={"batch_size": 8, "max_tokens_per_microbatch": 64},
    )
    trainer = FakeTrainer(kafka, names, S, inf.set_version, max_steps=steps)
    trainer.start()
    stages = [
        StageThread(preprocessor.run, config),
        StageThread(verifier.run, config),
        StageThread(actor.run, config, client_factory=inf.client_factory),
    ]
    for st in stages:
        st.start()
    try:
        loader.run(config)
        wait_for(lambda: trainer.finished.is_set(), timeout=120, what=f"{steps} trainer steps")
    finally:
        trainer.stop.set("test done")
        for st in stages:
            st.finish()
    assert trainer.error is None, trainer.error
    return trainer


def test_pipeline_with_max_lag_1_never_trains_a_sample_more_than_one_version_stale(
    kafka: KafkaTransport, run_names: TopicNames, kafka_bootstrap: str, inference: Inference
) -> None:
    trainer = run_with_trainer(kafka, run_names, kafka_bootstrap, inference, "pipeline", steps=8)
    lags = Counter(lag for _rid, lag in trainer.trained)
    assert len(trainer.steps) == 8 and sum(lags.values()) >= 64
    assert max(lags) <= 1, lags
    assert lags[1] > 0, lags  # and generation did run ahead of training
    assert len({rid for rid, _ in trainer.trained}) == len(trainer.trained)  # nothing trained twice


def test_conventional_mode_trains_every_sample_on_policy(
    kafka: KafkaTransport, run_names: TopicNames, kafka_bootstrap: str, inference: Inference
) -> None:
    trainer = run_with_trainer(kafka, run_names, kafka_bootstrap, inference, "conventional", steps=5)
    assert [len(step) for step in trainer.steps] == [8] * 5  # exactly one step's worth per version
    assert {lag for _rid, lag in trainer.trained} == {0}
