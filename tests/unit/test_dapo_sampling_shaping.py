"""DAPO's pure helpers: dynamic-sampling group selection and overlong reward shaping (eq. 13)."""

import pytest
import torch

from nemo_sspo.algorithms.dynamic_sampling import (
    NotEnoughGroupsError,
    select_nonzero_variance_groups,
)
from nemo_sspo.algorithms.reward_shaping import overlong_reward_shaping


def test_selection_hand_case():
    # G = 3: [1 1 1] equal | [0 1 0] varies | [0 0 0] equal | [2 2 3] varies -> groups 1 and 3.
    rewards = torch.tensor([1.0, 1, 1, 0, 1, 0, 0, 0, 0, 2, 2, 3])
    sel = select_nonzero_variance_groups(rewards, 3)
    assert sel.indices.tolist() == [1, 3]
    assert (sel.num_groups, sel.num_nonzero_variance, sel.enough) == (4, 2, True)
    assert sel.rows(3).tolist() == [3, 4, 5, 9, 10, 11]
    first = select_nonzero_variance_groups(rewards, 3, target_groups=1)
    assert first.indices.tolist() == [1] and first.enough


def test_selection_reports_and_raises_when_short():
    rewards = torch.tensor([1.0, 1, 1, 0, 1, 0, 0, 0, 0, 2, 2, 3])
    short = select_nonzero_variance_groups(rewards, 3, target_groups=3)
    assert not short.enough and short.indices.tolist() == [1, 3]
    with pytest.raises(NotEnoughGroupsError, match=r"only 2 of 4 groups.*target_groups=3"):
        select_nonzero_variance_groups(rewards, 3, target_groups=3, strict=True)
    assert issubclass(NotEnoughGroupsError, ValueError)


def test_group_size_one_never_has_variance():
    sel = select_nonzero_variance_groups(torch.tensor([0.0, 1.0, 1.0]), 1, target_groups=1)
    assert sel.indices.tolist() == [] and not sel.enough


@pytest.mark.parametrize("seed", range(5))
def test_property_never_returns_a_zero_variance_group(seed):
    gen = torch.Generator().manual_seed(seed)
    group, groups, target = 4, 16, 5
    rewards = torch.randint(0, 2, (groups * group,), generator=gen).float()
    sel = select_nonzero_variance_groups(rewards, group, target_groups=target)
    kept = rewards[sel.rows(group)].reshape(-1, group)
    assert (kept.amax(1) != kept.amin(1)).all()
    # Independent count of varying groups: a 0/1 group varies iff its sum is strictly inside (0, G).
    varying = ((rewards.reshape(-1, group).sum(1) > 0) & (rewards.reshape(-1, group).sum(1) < group))
    assert sel.num_nonzero_variance == int(varying.sum())
    assert sel.enough == (int(varying.sum()) >= target)
    assert len(sel.indices) == min(target, int(varying.sum()))


@pytest.mark.parametrize(("kwargs", "pattern"), [
    (dict(rewards=torch.zeros(5), group_size=2), "multiple of group_size"),
    (dict(rewards=torch.tensor([0.0, float("nan")]), group_size=2), "not finite"),
    (dict(rewards=torch.zeros(4), group_size=2, target_groups=0), "target_groups"),
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
