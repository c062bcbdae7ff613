"""What one held-out evaluation computes (pure functions; the evaluator stage samples and calls them).

- `is_due(version, every, final)`: versions 0, every, 2·every, ... and the final one are evaluated.
- `Outcome`: one scored sample: problem, greedy or not, verdict, reward, its completion tokens
  and how many of them the version spans attribute to another version than the evaluated one.
- `aggregate(outcomes, ...)`: the `EvalResult`. pass@1 is greedy accuracy over problems;
  with k samples per problem, sampled pass@1 is their mean correctness and pass@k the fraction
  of problems with at least one correct sample (the unbiased estimator with n = k).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from stream_rl.contracts import EvalResult, Verdict, VersionSpan, now_ms, token_versions


def is_due(version: int, every: int, final: bool) -> bool:
    """Whether `version` is evaluated with `eval.every = every` (> 0)."""
    return final or version % every == 0


@dataclass(frozen=True, slots=True)
class Outcome:
    problem_id: str
    greedy: bool
    verdict: Verdict
    reward: float
    tokens: int
    """Sampled completion tokens (environment tokens of multi-turn rollouts excluded)."""
    off_version_tokens: int
    min_version: int
    max_version: int


def count_versions(
    spans: Sequence[VersionSpan], length: int, version: int, mask: Sequence[bool] | None = None
) -> tuple[int, int, int, int]:
    """(sampled tokens, tokens sampled by another version than `version`, min, max version) of one
    completion of `length` tokens; `mask` marks the sampled tokens (None: all)."""
    per_token = token_versions(list(spans), length)
    if mask is not None:
        per_token = [v for v, sampled in zip(per_token, mask, strict=True) if sampled]
    if not per_token:
        return 0, 0, version, version
    off = sum(1 for v in per_token if v != version)
    return len(per_token), off, min(per_token), max(per_token)


def aggregate(
    outcomes: Sequence[Outcome],
    *,
    run_id: str,
    version: int,
    task: str,
    split: str,
    num_problems: int,
    k: int,
    temperature: float,
    evaluator_id: str,
    started_ms: int,
) -> EvalResult:
    """The EvalResult of one version's outcomes (see the module docstring)."""
    greedy = [o for o in outcomes if o.greedy]
    sampled = [o for o in outcomes if not o.greedy]
    correct = Verdict.CORRECT
    pass_at_1 = sum(o.verdict is correct for o in greedy) / num_problems if greedy else None
    sampled_pass = pass_k = None
    if k and sampled:
        sampled_pass = sum(o.verdict is correct for o in sampled) / len(sampled)
        solved = {o.problem_id for o in sampled if o.verdict is correct}
        pass_k = len(solved) / num_problems
    tokens = sum(o.tokens for o in outcomes)
    return EvalResult(
        run_id=run_id,
        version=version,
        task=task,
        split=split,
        num_problems=num_problems,
        pass_at_1=pass_at_1,
        k=k if sampled else 0,
        temperature=temperature if sampled else 0.0,
        sampled_pass_at_1=sampled_pass,
        pass_at_k=pass_k,
        mean_reward=sum(o.reward for o in outcomes) / len(outcomes) if outcomes else 0.0,
        mean_length=tokens / len(outcomes) if outcomes else 0.0,
        verdicts=dict(Counter(o.verdict.value for o in outcomes)),
        tokens=tokens,
        off_version_tokens=sum(o.off_version_tokens for o in outcomes),
        min_token_version=min((o.min_version for o in outcomes), default=version),
        max_token_version=max((o.max_version for o in outcomes), default=version),
        greedy_correct=sorted(o.problem_id for o in greedy if o.verdict is correct),
        evaluator_id=evaluator_id,
        started_ms=started_ms,
        finished_ms=now_ms(),
    )
