"""Advantages against hand-computed float64 references."""

import math

import pytest

from stream_rl.rl.advantages import compute_advantages

pytestmark = pytest.mark.unit

TOL = 1e-6


def close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(abs(g - w) <= TOL for g, w in zip(got, want, strict=True))


def test_leave_one_out_is_the_default_and_matches_hand_values():
    # [1, 2, 4]: A_i = r_i - mean of the others = 1-3, 2-2.5, 4-1.5
    assert close(compute_advantages([1.0, 2.0, 4.0]), [-2.0, -0.5, 2.5])
    # 0/1 rewards: 1 - 1/3, 0 - 2/3
    assert close(compute_advantages([1, 0, 0, 1]), [2 / 3, -2 / 3, -2 / 3, 2 / 3])


def test_group_mean_baseline():
    assert close(compute_advantages([1.0, 2.0, 4.0], kind="mean"), [-4 / 3, -1 / 3, 5 / 3])
    assert close(compute_advantages([1, 0, 0, 1], kind="mean"), [0.5, -0.5, -0.5, 0.5])


def test_loo_is_mean_baseline_scaled_by_n_over_n_minus_1():
    rewards = [0.3, -1.2, 2.5, 0.0, 0.7]
    loo = compute_advantages(rewards)
    mean = compute_advantages(rewards, kind="mean")
    assert close(loo, [a * 5 / 4 for a in mean])


def test_divide_by_std_uses_sample_std_ddof1_plus_eps():
    # [1, 2, 4]: deviations -4/3, -1/3, 5/3 -> sum of squares 42/9, / (n-1) = 7/3
    std = math.sqrt(7 / 3)
    assert close(
        compute_advantages([1.0, 2.0, 4.0], divide_by_std=True),
        [-2.0 / (std + 1e-4), -0.5 / (std + 1e-4), 2.5 / (std + 1e-4)],
    )
    assert close(
        compute_advantages([1.0, 2.0, 4.0], kind="mean", divide_by_std=True, eps=0.5),
        [(-4 / 3) / (std + 0.5), (-1 / 3) / (std + 0.5), (5 / 3) / (std + 0.5)],
    )
    # [1, 0, 0, 1]: std = sqrt(1/3)
    s = math.sqrt(1 / 3)
    assert close(
        compute_advantages([1, 0, 0, 1], divide_by_std=True),
        [x / (s + 1e-4) for x in (2 / 3, -2 / 3, -2 / 3, 2 / 3)],
    )


def test_groups_of_one_and_empty_groups():
    assert compute_advantages([5.0]) == [0.0]
    assert compute_advantages([5.0], kind="mean", divide_by_std=True) == [0.0]
    assert compute_advantages([]) == []


def test_equal_rewards_give_exact_zeros():
    # 0.1 * 7 does not round-trip through a sum: the result must still be exactly zero.
    for kind in ("loo", "mean"):
        for div in (False, True):
            assert compute_advantages([0.1] * 7, kind=kind, divide_by_std=div) == [0.0] * 7


def test_invalid_input_is_rejected():
    with pytest.raises(ValueError, match="non-finite"):
        compute_advantages([1.0, float("nan")])
    with pytest.raises(ValueError, match="unknown advantage kind"):
        compute_advantages([1.0, 0.0], kind="median")  # type: ignore[arg-type]
