"""Group-relative advantages (GRPO / SSPO eq. 3, Dr. GRPO variant), degenerate groups, bad input."""

import math
import random
import statistics

import pytest
import torch

from nemo_sspo.algorithms.advantages import group_advantages

ZERO_VAR = "advantages/zero_variance_group_frac"


def test_hand_values_population_std():
    # Group 1 [1, 0, 0, 0]: mean 1/4, population std sqrt(1/4 * 3/4) = sqrt(3)/4
    #   -> A = (3/4) / (sqrt(3)/4) = sqrt(3), (-1/4) / (sqrt(3)/4) = -1/sqrt(3).
    # Group 2 [1, 1, 0, 0]: mean 1/2, std 1/2 -> A = +-1.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    adv, stats = group_advantages(rewards, 4, eps=0.0)
    r3 = math.sqrt(3.0)
    expected = torch.tensor([r3, -1 / r3, -1 / r3, -1 / r3, 1.0, 1.0, -1.0, -1.0])
    assert adv.dtype == torch.float32
    assert torch.allclose(adv, expected, atol=1e-6)
    assert stats[ZERO_VAR] == 0.0
    # Default eps 1e-6 shifts these by a relative ~1e-6/0.43 ~ 2.3e-6 only.
    assert torch.allclose(group_advantages(rewards, 4)[0], expected, rtol=1e-5)


def test_dr_grpo_no_std_normalisation():
    # Dr. GRPO: A = r - mean_g: group means 1/4 and 1/2.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    adv, _ = group_advantages(rewards, 4, normalize_std=False)
    assert adv.tolist() == [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]


def test_matches_statistics_pstdev_reference():
    # Second algorithm: Python's statistics module (population std) on random rewards.
    rng = random.Random(11)
    rewards = [rng.uniform(-2, 3) for _ in range(12)]
    adv, _ = group_advantages(torch.tensor(rewards, dtype=torch.float64), 6, eps=1e-6)
    for start in (0, 6):
        group = rewards[start:start + 6]
        mean, std = statistics.fmean(group), statistics.pstdev(group)
        for k, r in enumerate(group):
            assert adv[start + k].item() == pytest.approx((r - mean) / (std + 1e-6), rel=1e-6)


def test_p15_all_rewards_zero():
    # docs/pitfalls.md#p15: every response truncated, all rewards 0 -> advantages exactly 0, no NaN, fraction 1.
    adv, stats = group_advantages(torch.zeros(8), 4)
    assert adv.tolist() == [0.0] * 8
    assert stats[ZERO_VAR] == 1.0


def test_zero_variance_group_among_others():
    # Group 1 [0.1, 0.1, 0.1] equal (float mean may differ by 1 ulp; still exactly 0).
    # Group 2 [1, 2, 3]: mean 2, population std sqrt(2/3) -> A = -+sqrt(3/2), 0.
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 2.0, 3.0])
    adv, stats = group_advantages(rewards, 3, eps=0.0)
    s = math.sqrt(1.5)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert torch.allclose(adv[3:], torch.tensor([-s, 0.0, s]), atol=1e-6)
    assert stats[ZERO_VAR] == 0.5


def test_group_size_one_gives_zero():
    adv, stats = group_advantages(torch.tensor([1.0, 0.0, 5.0]), 1)
    assert adv.tolist() == [0.0, 0.0, 0.0]
    assert stats[ZERO_VAR] == 1.0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_names_row(bad):
    rewards = torch.tensor([1.0, 0.0, bad, 1.0])
    with pytest.raises(ValueError, match=r"rewards\[2\].*reward function must return finite"):
        group_advantages(rewards, 2)


def test_batch_not_multiple_of_group_raises():
    with pytest.raises(ValueError, match="group_size=4"):
        group_advantages(torch.zeros(6), 4)


@pytest.mark.parametrize(("rewards", "group_size", "pattern"), [
    (torch.zeros(2, 2), 2, "1-D"),
    (torch.zeros(4), 0, "positive int"),
])
def test_bad_arguments_raise(rewards, group_size, pattern):
    with pytest.raises(ValueError, match=pattern):
        group_advantages(rewards, group_size)
