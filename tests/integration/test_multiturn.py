"""The multi-turn `guessing` task against the real tiny inference server (in a thread): through the
actor on a real broker, and one long game driven directly. The random model's replies are mostly
not valid UTF-8 (so their text does not re-encode to their tokens): every rollout must still be
produced, with its sampled tokens untouched, and scoring the sequence with the model must give
back the behaviour logprobs (what the trainer relies on)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from stage_helpers import count, make_config, publish_version, read

from stream_rl.config import SamplingConfig
from stream_rl.contracts import ChatMessage, Problem, Rollout, Verdict, VersionSpan
from stream_rl.kafka.confluent import KafkaTransport
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.topics import PROBLEMS, RAW_ROLLOUTS, TopicNames
from stream_rl.stages import actor, loader
from stream_rl.stages.rollouts import ChatTokenizer, TurnClient
from stream_rl.tasks import Completion, get_task

pytestmark = pytest.mark.integration
serde = default_serde()
SAMPLING = {"max_tokens": 8, "temperature": 1.0}


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    import torch
    from fakes.server_thread import ServerThread

    from stream_rl.inference.engine import Engine
    from stream_rl.inference.model_maker import make_model

    torch.set_num_threads(1)
    path = make_model(tmp_path_factory.mktemp("model") / "tiny", "tiny", seed=0)
    with ServerThread(Engine.load(path, seed=0)) as server:
        server.model_path = str(path)
        yield server


def model_logprobs(engine: Any, prompt: list[int], completion: list[int]) -> list[float]:
    """The model's logprob of each completion token given everything before it (temperature 1)."""
    import torch

    from stream_rl.rl.logprobs import token_logprobs

    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0]
    start = len(prompt)
    scored = token_logprobs(logits[start - 1 : -1], ids[0, start:])
    return [float(x) for x in scored]


def check_sequence(engine: Any, r: Rollout | Any, mask: list[bool]) -> None:
    """Mask, logprobs and spans agree, and the model scores the sampled tokens as they were sampled."""
    n = len(r.completion_token_ids)
    assert len(mask) == len(r.logprobs) == n and any(mask) and not all(mask)
    assert all(lp == 0.0 for lp, m in zip(r.logprobs, mask, strict=True) if not m)
    assert all(lp < 0.0 for lp, m in zip(r.logprobs, mask, strict=True) if m)
    rescored = model_logprobs(engine, r.prompt_token_ids, r.completion_token_ids)
    for i in (i for i in range(n) if mask[i]):
        assert rescored[i] == pytest.approx(r.logprobs[i], abs=2e-3), i


def test_actor_produces_guessing_rollouts_from_the_tiny_model(
    kafka: KafkaTransport, run_names: TopicNames, kafka_bootstrap: str, tiny_server: Any
) -> None:
    params = {"max_number": 16, "max_turns": 3, "num_problems": 2}
    config = make_config(
        run_names,
        kafka_bootstrap,
        task={"name": "guessing", "params": params},
        actor={"group_size": 2, "sampling": SAMPLING},
        inference={"servers": [{"url": tiny_server.url}]},
        model={"path": tiny_server.model_path},
    )
    publish_version(kafka, run_names, 0)
    assert loader.run(config).records_out == 2
    stats = actor.run(config, max_records=2, idle_timeout_s=30)
    assert count(kafka, run_names.dlq(PROBLEMS)) == 0  # nothing dead-lettered
    rollouts = [serde.decode(m.value, Rollout) for m in read(kafka, run_names[RAW_ROLLOUTS])]
    assert stats.records_out == 4 and len(rollouts) == 4
    task = get_task("guessing", params)
    tokenizer = ChatTokenizer(tiny_server.model_path)
    for r in rollouts:
        r.validate()
        assert r.completion_mask is not None and r.num_turns is not None and r.num_turns >= 1
        assert r.version_spans == [VersionSpan(0, 0)]
        assert r.prompt_token_ids == tokenizer.render(r.problem.prompt)
        assert r.text == tokenizer.decode(r.completion_token_ids) and "[game over:" in r.text
        assert task.score(r.problem, r.text).verdict in (Verdict.CORRECT, Verdict.WRONG, Verdict.NO_ANSWER)
        check_sequence(tiny_server.engine, r, r.completion_mask)


class WrongGuesses:
    """The real server's replies with their text swapped for a wrong guess: the random model never
    writes `<answer>N</answer>`, so this keeps the game going for every turn (the sampled tokens,
    logprobs and spans are the server's, untouched)."""

    def __init__(self, inner: TurnClient) -> None:
        self.inner = inner
        self.sampled: list[list[int]] = []

    async def complete(self, prompt_token_ids: list[int], sampling: SamplingConfig) -> Completion:
        c = await self.inner.complete(prompt_token_ids, sampling)
        self.sampled.append(list(c.token_ids))
        return replace(c, text=f"{c.text}<answer>{2 * len(self.sampled)}</answer>")

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        return self.inner.render(messages, add_generation_prompt)

    def decode(self, token_ids: list[int]) -> str:
        return self.inner.decode(token_ids)


def test_a_long_game_with_the_tiny_model_is_one_sequence_the_model_scores_back(tiny_server: Any) -> None:
    from stream_rl.inference.builtin_client import BuiltinClient

    task = get_task("guessing", {"max_number": 16, "max_turns": 4})
    problem: Problem = next(p for p in task.load_problems("run", 0) if p.answer == "9")
    tokenizer = ChatTokenizer(tiny_server.model_path)

    async def play() -> tuple[Any, WrongGuesses]:
        async with BuiltinClient(tiny_server.url) as http:
            client = WrongGuesses(TurnClient(http, tokenizer, seed=7))
            return await task.generate_rollout(client, problem, SamplingConfig(**SAMPLING)), client

    r, client = asyncio.run(play())
    assert r.num_turns == 4 and r.scored.verdict is Verdict.WRONG
    sampled = [t for t, m in zip(r.completion_token_ids, r.completion_mask, strict=True) if m]
    assert sampled == [t for ids in client.sampled for t in ids]
    check_sequence(tiny_server.engine, r, r.completion_mask)
