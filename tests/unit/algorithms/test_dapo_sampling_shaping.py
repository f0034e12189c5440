"""DAPO's pure helpers: dynamic-sampling group selection and overlong reward shaping (eq. 13)."""

import math

import pytest
import torch

from nemo_sspo.algorithms.advantages import group_advantages
from nemo_sspo.algorithms.dynamic_sampling import select_nonzero_variance_groups
from nemo_sspo.algorithms.reward_shaping import overlong_reward_shaping


def test_selection_hand_case():
    # G = 3: [1 1 1] equal | [0 1 0] varies | [0 0 0] equal | [2 2 3] varies -> groups 1 and 3.
    rewards = torch.tensor([1.0, 1, 1, 0, 1, 0, 0, 0, 0, 2, 2, 3])
    assert select_nonzero_variance_groups(rewards, 3).tolist() == [1, 3]


def test_samples_per_prompt_one_never_has_variance():
    assert select_nonzero_variance_groups(torch.tensor([0.0, 1.0, 1.0]), 1).tolist() == []


@pytest.mark.parametrize("seed", range(5))
def test_property_keeps_exactly_the_varying_groups(seed):
    gen = torch.Generator().manual_seed(seed)
    group, groups = 4, 16
    rewards = torch.randint(0, 2, (groups * group,), generator=gen).float()
    # Independent test: a 0/1 group varies iff its sum is strictly inside (0, G).
    sums = rewards.reshape(-1, group).sum(1)
    varying = torch.nonzero((sums > 0) & (sums < group)).flatten()
    assert select_nonzero_variance_groups(rewards, group).tolist() == varying.tolist()


@pytest.mark.parametrize(("kwargs", "pattern"), [
    (dict(rewards=torch.zeros(5), samples_per_prompt=2), "multiple of samples_per_prompt"),
    (dict(rewards=torch.tensor([0.0, float("nan")]), samples_per_prompt=2), "not finite"),
])
def test_selection_errors(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        select_nonzero_variance_groups(**kwargs)


def test_overlong_shaping_eq13_hand_values():
    # L_max = 20, L_cache = 5: free up to 15 tokens, linear to -1 at 20, -1 beyond.
    # 16 -> (15 - 16) / 5 = -0.2; 18 -> -0.6; 20 -> -1; 25 -> -1. Scaled by penalty 0.5.
    lengths = torch.tensor([10, 15, 16, 18, 20, 25])
    shaped = overlong_reward_shaping(lengths, max_len=20, cache_len=5, penalty=0.5)
    assert shaped.dtype == torch.float32
    assert torch.allclose(shaped, torch.tensor([0.0, 0.0, -0.1, -0.3, -0.5, -0.5]), atol=1e-7)
    assert overlong_reward_shaping(lengths, 20, 20).tolist()[0] == pytest.approx(-0.5)  # 10-20 ramp


@pytest.mark.parametrize(("args", "pattern"), [
    ((torch.zeros(2, 2), 10, 2), "1-D"),
    ((torch.tensor([3]), 0, 1), "max_len"),
    ((torch.tensor([3]), 10, 11), "cache_len"),
    ((torch.tensor([3]), 10, 0), "cache_len"),
    ((torch.tensor([-1]), 10, 2), ">= 0"),
])
def test_overlong_shaping_errors(args, pattern):
    with pytest.raises(ValueError, match=pattern):
        overlong_reward_shaping(*args)
    with pytest.raises(ValueError, match="penalty"):
        overlong_reward_shaping(torch.tensor([3]), 10, 2, penalty=-1.0)


# Issue 10 item 4: overlong shaping on a group whose task rewards are all equal. L_max = 8 and
# L_cache = 4 leave lengths <= 4 free; 5 -> (4 - 5) / 4 = -0.25, 6 -> (4 - 6) / 4 = -0.5.
_LENGTHS = torch.tensor([3, 4, 5, 6])


def test_shaping_alone_gives_a_group_no_advantage():
    # All wrong: shaped rewards [0, 0, -0.25, -0.5] would give (mean -0.1875, population std
    # sqrt(0.171875 / 4) = 0.20729) advantages [0.9045, 0.9045, -0.3015, -1.5076], a gradient
    # from length alone. The task rewards decide: the group has no signal, advantage exactly 0.
    task = torch.zeros(4)
    shaped = task + overlong_reward_shaping(_LENGTHS, max_len=8, cache_len=4)
    assert shaped.tolist() == [0.0, 0.0, -0.25, -0.5]
    advantages, stats = group_advantages(shaped, 4, task_rewards=task)
    assert advantages.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert stats["advantages/zero_variance_group_frac"] == 1.0


def test_shaping_still_ranks_responses_of_a_group_with_task_variance():
    # Group 0 all correct (no signal, as above); group 1 = task [1, 0, 1, 0] + shaping
    # [0, 0, -0.25, -0.5] = [1, 0, 0.75, -0.5]: mean 0.3125, deviations [0.6875, -0.3125, 0.4375,
    # -0.8125], population variance 1.421875 / 4 = 0.35546875.
    task = torch.tensor([1.0, 1, 1, 1, 1, 0, 1, 0])
    shaped = task + overlong_reward_shaping(_LENGTHS.repeat(2), max_len=8, cache_len=4)
    advantages, stats = group_advantages(shaped, 4, task_rewards=task, eps=0.0)
    deviations = torch.tensor([0.6875, -0.3125, 0.4375, -0.8125], dtype=torch.float64)
    expected = deviations / math.sqrt(0.35546875)  # [1.1531, -0.5241, 0.7338, -1.3628]
    assert advantages[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(advantages[4:], expected.float(), rtol=0, atol=1e-6)
    assert stats["advantages/zero_variance_group_frac"] == 0.5


def test_task_rewards_must_match_rewards():
    with pytest.raises(ValueError, match="task_rewards"):
        group_advantages(torch.zeros(4), 2, task_rewards=torch.zeros(2))
