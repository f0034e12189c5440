"""Group-relative advantages (GRPO / SSPO eq. 3, Dr. GRPO variant), degenerate groups, bad input."""

import math
import random
import statistics

import pytest
import torch

from nemo_sspo.algorithms.advantages import PromptRewardStats, group_advantages, smooth_group_advantages

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


def test_samples_per_prompt_one_gives_zero():
    adv, stats = group_advantages(torch.tensor([1.0, 0.0, 5.0]), 1)
    assert adv.tolist() == [0.0, 0.0, 0.0]
    assert stats[ZERO_VAR] == 1.0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_names_row(bad):
    rewards = torch.tensor([1.0, 0.0, bad, 1.0])
    with pytest.raises(ValueError, match=r"rewards\[2\].*reward function must return finite"):
        group_advantages(rewards, 2)


def test_batch_not_multiple_of_group_raises():
    with pytest.raises(ValueError, match="samples_per_prompt=4"):
        group_advantages(torch.zeros(6), 4)


@pytest.mark.parametrize(("rewards", "samples_per_prompt", "pattern"), [
    (torch.zeros(2, 2), 2, "1-D"),
    (torch.zeros(4), 0, "positive int"),
])
def test_bad_arguments_raise(rewards, samples_per_prompt, pattern):
    with pytest.raises(ValueError, match=pattern):
        group_advantages(rewards, samples_per_prompt)


# ---- DCPO smooth advantage standardisation (lime-RL/DCPO core_algos.py get_mean_std and
# compute_dcpo_outcome_advantage). One prompt "p", G = 4, visits 1-3; stds are unbiased (n - 1).
def _visit(rewards, history, **kwargs):
    return smooth_group_advantages(torch.tensor(rewards), 4, ["p"], history, **kwargs)


def test_smooth_standardisation_hand_values_over_three_visits():
    # Visit 1, r = [1, 1, 0, 0]: mu = 0.5, s^2 = 4 * 0.25 / 3 = 1/3; A = z = +-0.5 * sqrt(3) = +-0.866025.
    adv, history = _visit([1.0, 1.0, 0.0, 0.0], {})
    torch.testing.assert_close(adv, torch.tensor([0.866025, 0.866025, -0.866025, -0.866025]), rtol=0, atol=1e-6)
    assert history["p"] == PromptRewardStats(1, 0.5, pytest.approx(math.sqrt(1 / 3), abs=1e-15))
    # Visit 2, r = [1, 1, 1, 1] (GRPO's advantage would be 0): mu_new = 1, s_new = 0 -> z_new = 0.
    # mu_cum = (0.5 + 1) / 2 = 0.75; s_cum^2 = (1/3 + 0 + (1/2)(1 - 0.5)^2) / 2 = 11/48.
    # z_cum = 0.25 / sqrt(11/48) = 0.522233; A1 = z_cum / 2 = 0.261116 = A2 = (1/2) z_cum.
    adv, history = _visit([1.0] * 4, history)
    torch.testing.assert_close(adv, torch.full((4,), 0.261116), rtol=0, atol=1e-6)
    assert (history["p"].visits, history["p"].mean) == (2, 0.75)
    assert history["p"].std == pytest.approx(math.sqrt(11 / 48), abs=1e-15)
    # Visit 3, r = [1, 0, 0, 0]: mu_new = 0.25, s_new^2 = (0.75^2 + 3 * 0.25^2) / 3 = 0.25 -> s_new = 0.5.
    # mu_cum = (2 * 0.75 + 0.25) / 3 = 7/12; s_cum^2 = (2 * 11/48 + 0.25 + (2/3)(0.25 - 0.75)^2) / 3 = 7/24.
    # r = 1: z_new = 1.5, z_cum = (5/12) / sqrt(7/24) = 0.771517; A1 = 0.257172 + 1.0 = 1.257172,
    #        A2 = 0.5 + 0.514345 = 1.014345 -> A2 (smaller magnitude).
    # r = 0: z_new = -0.5, z_cum = -(7/12) / sqrt(7/24) = -1.080124; A1 = -0.360041 - 0.333333 = -0.693375,
    #        A2 = -0.166667 - 0.720083 = -0.886749 -> A1.
    adv, history = _visit([1.0, 0.0, 0.0, 0.0], history)
    torch.testing.assert_close(adv, torch.tensor([1.014345, -0.693375, -0.693375, -0.693375]), rtol=0, atol=1e-6)
    assert (history["p"].visits, history["p"].mean) == (3, pytest.approx(7 / 12, abs=1e-15))
    assert history["p"].std == pytest.approx(math.sqrt(7 / 24), abs=1e-15)


def test_smooth_standardisation_without_std_and_with_repeated_prompts_in_one_batch():
    history = {"p": PromptRewardStats(1, 0.5, math.sqrt(1 / 3))}
    # Centring only, visit 2 of r = [1, 1, 1, 1]: z_new = 0, z_cum = 1 - 0.75 = 0.25; A = 0.25 / 2 = 0.125.
    adv, _ = _visit([1.0] * 4, history, normalize_std=False)
    torch.testing.assert_close(adv, torch.full((4,), 0.125), rtol=0, atol=0)
    # Two groups of "p" and one of "q" in one batch: p's second group is p's next visit, and the
    # caller's history is not modified. Equal to visiting one group at a time.
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv, after = smooth_group_advantages(rewards, 4, ["p", "q", "p"], history)
    assert history == {"p": PromptRewardStats(1, 0.5, math.sqrt(1 / 3))}
    one_by_one, state = [], history
    for key, group in zip(["p", "q", "p"], rewards.split(4)):
        part, state = smooth_group_advantages(group, 4, [key], state)
        one_by_one.append(part)
    assert torch.equal(adv, torch.cat(one_by_one)) and after == state and after["p"].visits == 3


def test_smooth_standardisation_refuses_single_responses_and_bad_keys():
    with pytest.raises(ValueError, match="samples_per_prompt=1"):
        smooth_group_advantages(torch.tensor([1.0, 0.0]), 1, ["a", "b"], {})
    with pytest.raises(ValueError, match="keys has 1 entries for 2 groups"):
        smooth_group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 2, ["a"], {})
