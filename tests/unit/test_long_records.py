"""Record sizes of long rollouts against the topics' limits: bytes per token of every record on
the rollout path, measured on real encodings, and the longest sequence each topic carries."""

from __future__ import annotations

import random

import pytest

from stream_rl.contracts import (
    ChatMessage,
    PartialGroup,
    PendingSample,
    Problem,
    Rollout,
    ScoredRollout,
    TrainingBatch,
    TrainingSample,
    Verdict,
    VersionSpan,
)
from stream_rl.kafka.confluent import MAX_MESSAGE_BYTES
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.topics import load_topology
from stream_rl.stages.micro_batches import pack

pytestmark = pytest.mark.unit

PROMPT = 32


def scored(n: int, index: int = 0, vocab: int = 262) -> ScoredRollout:
    """A scored rollout with `n` completion tokens, a version span every 20% of them and text of
    one byte per token (the byte-level tokenizer): the long task's worst case per token."""
    rng = random.Random(n + index)
    problem = Problem(
        "r", "progression-17+3x300", 0, "progression", [ChatMessage("user", "count 17 to 914 by 3")]
    )
    rollout = Rollout(
        rollout_id=f"g.s{index}",
        group_id="g",
        sample_index=index,
        group_size=8,
        problem=problem,
        prompt_token_ids=[rng.randrange(6, vocab) for _ in range(PROMPT)],
        completion_token_ids=[rng.randrange(6, vocab) for _ in range(n)],
        logprobs=[-3 * rng.random() for _ in range(n)],
        version_spans=[VersionSpan(v, v * n // 5) for v in range(5)],
        finish_reason="stop",
        text="".join(chr(rng.randrange(48, 58)) for _ in range(n)),
        actor_id="actor-0",
        server_id="http://127.0.0.1:8100",
        started_ms=1,
        finished_ms=2,
        generation_ms=3.0,
    )
    return ScoredRollout(rollout=rollout, reward=1.0, verdict=Verdict.CORRECT, verifier_id="verifier-0")


def sample(s: ScoredRollout) -> TrainingSample:
    r = s.rollout
    n = len(r.completion_token_ids)
    return TrainingSample(
        rollout_id=r.rollout_id,
        group_id=r.group_id,
        input_ids=r.prompt_token_ids + r.completion_token_ids,
        prompt_len=PROMPT,
        loss_mask=[True] * n,
        advantages=[0.5] * n,
        behaviour_logprobs=r.logprobs,
        version_spans=r.version_spans,
        reward=1.0,
        verdict=Verdict.CORRECT,
        finish_reason="stop",
    )


def per_token(encode, n_short: int = 1_000, n_long: int = 11_000) -> float:  # type: ignore[no-untyped-def]
    """Marginal encoded bytes per completion token (fixed overhead cancels)."""
    return (encode(n_long) - encode(n_short)) / (n_long - n_short)


def test_bytes_per_token_and_the_longest_sequence_each_topic_carries() -> None:
    serde = default_serde()
    limits = {name: t.max_message_bytes or MAX_MESSAGE_BYTES for name, t in load_topology().items()}
    rollout = per_token(lambda n: len(serde.encode(scored(n).rollout)))
    score = per_token(lambda n: len(serde.encode(scored(n))))
    batch = per_token(lambda n: len(serde.encode(TrainingBatch("b", "r", [sample(scored(n))], "p"))))
    # ids (2-byte varints), a float32 logprob and a byte of text per token: about 7 bytes; a
    # training sample adds its mask and float32 advantage and drops the text: about 11.
    assert 6.5 < rollout < 8 and 6.5 < score < 8 and 10 < batch < 12
    # One rollout or scored record of a 1M-token sequence would still fit the local broker's
    # 16 MiB (an external cluster's default is 1 MiB: ~140k tokens).
    assert 1_000_000 * score < limits["scored"] and 1_000_000 * rollout < limits["raw-rollouts"]
    # A single training sample travels alone when over max_batch_bytes: up to ~360k tokens fit
    # training-batches' 4 MiB.
    assert 360_000 * batch < limits["training-batches"]
    # The open-group state record holds every scored sample of the group so far: with groups
    # of 8, ~280k tokens per sample; with 64, ~35k.
    assert 8 * 280_000 * score < limits["preprocessor-state"]
    assert 64 * 35_000 * score < limits["preprocessor-state"]
    assert 64 * 40_000 * score > limits["preprocessor-state"]


def test_a_long_sample_over_the_batch_byte_limit_travels_alone_and_whole() -> None:
    serde = default_serde()
    samples = [sample(scored(n, i)) for i, n in enumerate([50, 9_000, 40, 60])]
    out = pack(
        samples,
        max_tokens=100_000,
        max_bytes=50_000,  # the 9,000-token sample alone encodes to ~99 kB
        num_filtered=0,
        filtered_keys=[],
        encode=serde.encode,
        run_id="r",
        producer_id="p",
    )
    contents = [[s.rollout_id for s in tb.samples] for tb, _ in out]
    assert ["g.s1"] in contents
    assert sorted(r for c in contents for r in c) == sorted(s.rollout_id for s in samples)
    alone = next(data for tb, data in out if [s.rollout_id for s in tb.samples] == ["g.s1"])
    assert 50_000 < len(alone) < 4 * 2**20
    assert serde.decode(alone, TrainingBatch).samples[0].input_ids == samples[1].input_ids


def test_open_group_state_of_the_long_task() -> None:
    """The long-cpu run's worst case (groups of 8 at max_tokens 1,040) is far below the limit."""
    serde = default_serde()
    members = [scored(1_040, i) for i in range(7)]
    state = PartialGroup(
        "g",
        0,
        False,
        [PendingSample(s.rollout.rollout_id, i, serde.encode(s)) for i, s in enumerate(members)],
    )
    assert len(serde.encode(state)) < 100_000 < load_topology()["preprocessor-state"].max_message_bytes
