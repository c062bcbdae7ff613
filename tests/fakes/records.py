"""Builders of realistic contract objects, for tests and benchmarks (not used by the stages)."""

from __future__ import annotations

import dataclasses
import random
import struct

from stream_rl.contracts import (
    ChatMessage,
    EvalResult,
    MembershipState,
    PartialGroup,
    PartitionOffset,
    PendingSample,
    Problem,
    Rollout,
    ScoredRollout,
    ServerMembership,
    TrainingBatch,
    TrainingSample,
    Verdict,
    VersionSpan,
    WeightVersion,
    WeightVersionKind,
)


def f32(x: float) -> float:
    """x rounded to float32, as Avro `float` fields carry it."""
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


def make_problem(i: int = 0, run_id: str = "test", epoch: int = 0) -> Problem:
    a, b = (i * 37) % 100, (i * 91 + 7) % 100
    return Problem(
        run_id=run_id,
        problem_id=f"arith-{i:06d}",
        epoch=epoch,
        task="arithmetic",
        prompt=[ChatMessage("user", f"{a}+{b}=")],
        answer=str(a + b),
        metadata={"a": str(a), "b": str(b)},
        created_ms=1_700_000_000_000 + i,
    )


def make_rollout(
    i: int = 0,
    sample_index: int = 0,
    group_size: int = 4,
    completion_len: int = 8,
    prompt_len: int = 12,
    versions: tuple[int, ...] = (0,),
    seed: int | None = None,
    run_id: str = "test",
) -> Rollout:
    """A rollout whose completion spans `versions` (one span each, equal parts)."""
    rng = random.Random(seed if seed is not None else i * 1000 + sample_index)
    problem = make_problem(i, run_id=run_id)
    group_id = Rollout.make_group_id(problem)
    step = max(completion_len // len(versions), 1)
    spans = [VersionSpan(v, k * step) for k, v in enumerate(versions) if k * step < completion_len] or [
        VersionSpan(versions[0], 0)
    ]
    return Rollout(
        rollout_id=Rollout.make_rollout_id(group_id, sample_index),
        group_id=group_id,
        sample_index=sample_index,
        group_size=group_size,
        problem=problem,
        prompt_token_ids=[rng.randrange(64) for _ in range(prompt_len)],
        completion_token_ids=[rng.randrange(64) for _ in range(completion_len)],
        logprobs=[f32(-rng.random() * 3) for _ in range(completion_len)],
        version_spans=spans if completion_len else [],
        finish_reason="stop",
        text="".join(str(rng.randrange(10)) for _ in range(completion_len)),
        actor_id="actor-0",
        server_id="http://127.0.0.1:8100",
        started_ms=1_700_000_000_000,
        finished_ms=1_700_000_000_050,
        generation_ms=50.0,
    )


def make_scored(
    i: int = 0, sample_index: int = 0, group_size: int = 4, reward: float | None = None, **kwargs: object
) -> ScoredRollout:
    rollout = make_rollout(i, sample_index, group_size, **kwargs)  # type: ignore[arg-type]
    r = float(sample_index % 2) if reward is None else reward
    return ScoredRollout(
        rollout=rollout,
        reward=r,
        verdict=Verdict.CORRECT if r > 0 else Verdict.WRONG,
        verifier_id="verifier-0",
        detail="",
        scored_ms=1_700_000_000_100,
    )


def make_scored_groups(
    rewards: list[list[float]], group_size: int | None = None, run_id: str = "test"
) -> list[ScoredRollout]:
    """Group i (problem i) gets one sample per reward in `rewards[i]`, in sample order; with
    `group_size` larger than a list, that group is incomplete. Completions vary in length."""
    out = []
    for i, group in enumerate(rewards):
        size = group_size if group_size is not None else len(group)
        for k, r in enumerate(group):
            out.append(make_scored(i, k, size, reward=r, completion_len=3 + (i + k) % 5, run_id=run_id))
    return out


def make_training_sample(scored: ScoredRollout, advantage: float = 0.5) -> TrainingSample:
    r = scored.rollout
    n = len(r.completion_token_ids)
    return TrainingSample(
        rollout_id=r.rollout_id,
        group_id=r.group_id,
        input_ids=r.prompt_token_ids + r.completion_token_ids,
        prompt_len=len(r.prompt_token_ids),
        loss_mask=[True] * n,
        advantages=[f32(advantage)] * n,
        behaviour_logprobs=list(r.logprobs),
        version_spans=list(r.version_spans),
        reward=scored.reward,
        verdict=scored.verdict,
        finish_reason=r.finish_reason,
    )


def make_batch(n_samples: int = 4, batch_id: str = "batch-0", run_id: str = "test") -> TrainingBatch:
    samples = [make_training_sample(make_scored(0, k, n_samples)) for k in range(n_samples)]
    return TrainingBatch(
        batch_id=batch_id,
        run_id=run_id,
        samples=samples,
        producer_id="preprocessor-0",
        created_ms=1_700_000_000_200,
    )


def make_weight_version(version: int = 1, run_id: str = "test") -> WeightVersion:
    return WeightVersion(
        run_id=run_id,
        version=version,
        step=version,
        kind=WeightVersionKind.INIT if version == 0 else WeightVersionKind.UPDATE,
        samples_trained=64 * version,
        tokens_trained=64 * 40 * version,
        checksum="ab" * 32,
        consumed_offsets=[PartitionOffset("stream-rl.test.training-batches", 0, 10 * version)],
        broadcast_ms=12.5,
        servers_updated=["http://127.0.0.1:8100"],
        checkpoint_uri=None,
        created_ms=1_700_000_000_300,
        metrics={"loss": 0.1, "reward_mean": 0.5},
    )


def make_partial_group(i: int = 0, received: int = 2, group_size: int = 4) -> PartialGroup:
    """An open group holding its first `received` samples (encoded as consumed)."""
    from stream_rl.kafka.serde import default_serde

    serde = default_serde()
    samples = [
        PendingSample(s.rollout.rollout_id, 100 + k, serde.encode(s))
        for k, s in enumerate(make_scored(i, k, group_size) for k in range(received))
    ]
    return PartialGroup(
        group_id=Rollout.make_group_id(make_problem(i)),
        partition=1,
        closed=False,
        samples=samples,
        first_seen_ms=1_700_000_000_400,
        updated_ms=1_700_000_000_500,
    )


def make_eval_result(version: int = 4) -> EvalResult:
    return EvalResult(
        run_id="r",
        version=version,
        task="arithmetic",
        split="held-out",
        num_problems=4,
        pass_at_1=0.75,
        k=2,
        temperature=1.0,
        sampled_pass_at_1=0.5,
        pass_at_k=0.75,
        mean_reward=0.58,
        mean_length=3.0,
        verdicts={"correct": 7, "wrong": 5},
        tokens=36,
        off_version_tokens=3,
        min_token_version=version,
        max_token_version=version + 1,
        greedy_correct=["arithmetic-1+2", "arithmetic-3+4", "arithmetic-5+6"],
        evaluator_id="eval-0",
        started_ms=1_700_000_000_600,
        finished_ms=1_700_000_000_700,
    )


def make_membership(url: str = "http://10.0.0.7:8001", state: str = "joined") -> ServerMembership:
    return ServerMembership(
        run_id="r1", url=url, engine="builtin", state=MembershipState(state), announced_by="test"
    )


def examples() -> list[object]:
    """One of each contract."""
    return [
        make_problem(3),
        dataclasses.replace(make_rollout(3, 1, versions=(2, 3)), problem_partition=1),
        make_scored(3, 1),
        dataclasses.replace(make_batch(), num_filtered=4, filtered_by_partition={2: 4}),
        dataclasses.replace(make_weight_version(2), consumed_by_partition={0: 3, 1: 5}),
        make_partial_group(3),
        make_eval_result(),
        make_membership(),
    ]
