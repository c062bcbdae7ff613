"""What a chaos run is judged by, counted from its topics with the outside decoder (`outside.py`)
alone: shared by `test_chaos.py` (one broker, every stage killed, bounces) and
`test_cluster_chaos.py` (three brokers, leaders killed)."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from outside import Decoder, committed, read_topic, topic

TOPICS = ("problems", "problems.dlq", "raw-rollouts", "scored", "scored.dlq", "training-batches")


def collect(bootstrap: str, run: str, decoder: Decoder) -> dict[str, Any]:
    """Every record of the run's data topics, its weight versions and the stages' committed offsets."""
    data: dict[str, Any] = {}
    for name in TOPICS:
        data[name] = [
            (p, o, decoder.decode(v)[1] if v else None) for p, o, v in read_topic(bootstrap, topic(run, name))
        ]
    data["weight-versions"] = [
        decoder.decode(v)[1] for _p, _o, v in read_topic(bootstrap, topic(run, "weight-versions")) if v
    ]
    for group, name in (("actor", "problems"), ("verifier", "raw-rollouts"), ("preprocessor", "scored")):
        data[f"committed.{group}"] = committed(bootstrap, f"stream-rl.{run}.{group}", topic(run, name))
    return data


def trained(data: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """(weights version that trained it, sample) of every sample the final lineage consumed."""
    versions = {}
    for wv in data["weight-versions"]:
        versions.setdefault(wv["version"], wv)
    bounds = sorted((v, sum(o["offset"] for o in wv["consumed_offsets"])) for v, wv in versions.items())
    out = []
    for _p, offset, batch in data["training-batches"]:
        if batch is None:
            continue
        step = next((v for v, end in bounds if offset < end), None)
        if step is not None:
            out.extend((step - 1, s) for s in batch["samples"])
    return out


def versions_gapless(data: dict[str, Any], max_steps: int) -> None:
    versions = sorted({wv["version"] for wv in data["weight-versions"]})
    assert versions == list(range(max_steps + 1)), "versions 0..max_steps, gapless"


def nothing_lost(data: dict[str, Any], group_size: int) -> None:
    # Actor: every committed problem has its whole group in raw-rollouts, or is in problems.dlq.
    rollouts: dict[str, set[int]] = defaultdict(set)
    for _p, _o, r in data["raw-rollouts"]:
        rollouts[r["group_id"]].add(r["sample_index"])
    dlq = {(p["problem_id"], p["epoch"]) for _p, _o, p in data["problems.dlq"] if p}
    for part, offset, problem in data["problems"]:
        if offset < data["committed.actor"].get(part, -1):
            gid = f"{problem['problem_id']}.e{problem['epoch']}"
            assert (
                rollouts[gid] == set(range(group_size)) or (problem["problem_id"], problem["epoch"]) in dlq
            ), gid
    # Verifier: every committed rollout is scored.
    scored = {s["rollout"]["rollout_id"] for _p, _o, s in data["scored"]}
    for part, offset, r in data["raw-rollouts"]:
        if offset < data["committed.verifier"].get(part, -1):
            assert r["rollout_id"] in scored
    # Preprocessor: every committed scored group reached training-batches whole, or its DLQ.
    batched: dict[str, set[str]] = defaultdict(set)
    for _p, _o, b in data["training-batches"]:
        for s in (b or {}).get("samples", []):
            batched[s["group_id"]].add(s["rollout_id"])
    dead = {s["rollout"]["group_id"] for _p, _o, s in data["scored.dlq"] if s}
    for part, offset, s in data["scored"]:
        gid = s["rollout"]["group_id"]
        if offset < data["committed.preprocessor"].get(part, -1):
            assert len(batched[gid]) == group_size or gid in dead, gid


def none_trained_twice(data: dict[str, Any], group_size: int, at_least: int) -> None:
    """No sample reached training-batches or the optimizer twice, `at_least` trained, groups whole."""
    ids = [s["rollout_id"] for _p, _o, b in data["training-batches"] if b for s in b["samples"]]
    assert len(ids) == len(set(ids)), "a sample reached training-batches twice"
    ids = [s["rollout_id"] for _v, s in trained(data)]
    assert len(ids) >= at_least
    assert len(ids) == len(set(ids)), "a sample was trained twice"
    sizes = Counter(s["group_id"] for _p, _o, b in data["training-batches"] if b for s in b["samples"])
    assert set(sizes.values()) == {group_size}


def _lags(data: dict[str, Any], nonempty: bool = False) -> list[int]:
    """Per trained sample, its version lag (`nonempty`: completions of at least one token only)."""
    return [
        v - min(sp["version"] for sp in s["version_spans"])
        for v, s in trained(data)
        if s["version_spans"] and (not nonempty or len(s["input_ids"]) > s["prompt_len"])
    ]


def within_lag_bound(data: dict[str, Any], max_lag: int) -> None:
    lags = _lags(data)
    # max_lag is an admission bound: a group overtaken downstream can train at max_lag + 1.
    assert max(lags) <= max_lag + 1, Counter(lags)


def over_the_bound_only_as_reported(data: dict[str, Any], max_lag: int, at_most: float) -> None:
    """Under a partition leader's failover the admission bound's gap widens: the groups in the
    partition without a leader wait while the other partitions' flow and train, so they can be
    overtaken by more than one step (docs/concepts.md "The stages", actor). What holds then: at most
    `at_most` of the trained samples beyond `max_lag + 1`, and every sample beyond `max_lag`
    reported by the trainer (`samples_over_lag_bound` in its versions' metrics: never silently)."""
    lags = _lags(data)
    beyond = sum(1 for lag in lags if lag > max_lag + 1)
    assert beyond <= at_most * len(lags), Counter(lags)
    firsts: dict[int, dict[str, Any]] = {}
    for wv in data["weight-versions"]:
        firsts.setdefault(wv["version"], wv)
    reported = sum(int(wv["metrics"].get("samples_over_lag_bound", 0)) for wv in firsts.values())
    counted = _lags(data, nonempty=True)  # the trainer leaves empty completions out of its lags
    assert reported >= sum(1 for lag in counted if lag > max_lag), (reported, Counter(counted))


if __name__ == "__main__":  # `python chaos_checks.py BOOTSTRAP RUN`: `collect` as JSON (for a test
    import json  # whose own process cannot reach the broker: tests/e2e/test_several_hosts.py)
    import sys

    print(json.dumps(collect(sys.argv[1], sys.argv[2], Decoder()), default=str))
