"""The names of the responses per prompt before ``samples_per_prompt`` (``group_size``, ``min_group_size``)
still work for one release, with the same values and a FutureWarning naming the new name."""

import dataclasses
import math
import warnings

import pytest
import torch

from nemo_sspo.algorithms import (
    AdvantageEstimator,
    AdvantageInputs,
    estimate_advantages,
    group_advantages,
    register_advantage_estimator,
    select_nonzero_variance_groups,
    smooth_group_advantages,
    zero_variance_groups,
)
from nemo_sspo.algorithms.advantage_estimators import scope_index, unregister_advantage_estimator

# Two prompts, G = 2: [1, 0] differ, [1, 1] are equal.
R = torch.tensor([1.0, 0.0, 1.0, 1.0])


def _old_and_new(fn, *args, **kwargs):
    """``fn`` called with ``group_size=2`` (must warn) and with ``samples_per_prompt=2`` (must not)."""
    with pytest.warns(FutureWarning, match=rf"{fn.__name__}\(group_size=\.\.\.\).*samples_per_prompt="):
        old = fn(*args, group_size=2, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = fn(*args, samples_per_prompt=2, **kwargs)
    return old, new


def test_group_advantages_old_keyword():
    (old, old_stats), (new, new_stats) = _old_and_new(group_advantages, R, eps=0.0)
    # [1, 0]: mean 1/2, population std 1/2 -> +-1; [1, 1] equal -> 0.
    assert old.tolist() == new.tolist() == [1.0, -1.0, 0.0, 0.0]
    assert old_stats == new_stats == {"advantages/zero_variance_group_frac": 0.5}


def test_smooth_group_advantages_old_keyword():
    (old, old_history), (new, new_history) = _old_and_new(smooth_group_advantages, R, keys=["a", "b"], history={})
    # First visits: z-scores with the unbiased std. [1, 0]: mean 1/2, std sqrt(1/2) -> +-sqrt(1/2); [1, 1]: std 0 -> 0.
    h = math.sqrt(0.5)
    torch.testing.assert_close(old, torch.tensor([h, -h, 0.0, 0.0]))
    torch.testing.assert_close(new, old)
    assert old_history == new_history
    assert (old_history["a"].visits, old_history["a"].mean, old_history["b"].std) == (1, 0.5, 0.0)


def test_zero_variance_and_selection_old_keyword():
    old, new = _old_and_new(zero_variance_groups, R)
    assert old.tolist() == new.tolist() == [False, True]
    old, new = _old_and_new(select_nonzero_variance_groups, R)
    assert old.tolist() == new.tolist() == [0]


def test_scope_index_old_keyword():
    # 4 rows, G = 2, scope group: rows 0-1 are prompt 0, rows 2-3 prompt 1; 2 scopes.
    (old_index, old_scopes), (new_index, new_scopes) = _old_and_new(scope_index, 4, scope="group")
    assert old_index.tolist() == new_index.tolist() == [0, 0, 1, 1]
    assert old_scopes == new_scopes == 2


def test_old_and_new_keyword_together_are_refused():
    with pytest.raises(TypeError, match="pass samples_per_prompt= only"):
        group_advantages(R, group_size=2, samples_per_prompt=2)


def test_advantage_inputs_group_size_reads_samples_per_prompt():
    inputs = AdvantageInputs(R, R, samples_per_prompt=2)
    with pytest.warns(FutureWarning, match=r"AdvantageInputs\.samples_per_prompt"):
        assert inputs.group_size == 2
    with pytest.raises(AttributeError):
        inputs.group_size = 4  # read-only, as every field of the frozen inputs


def test_plugin_written_against_the_old_names_still_runs():
    def compute(inputs, stats):
        """r_i - mean_g(r), with G read by its old name."""
        grouped = inputs.rewards.to(torch.float64).reshape(-1, inputs.group_size)
        return (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)

    with pytest.warns(FutureWarning, match=r"pass min_samples_per_prompt="):
        estimator = AdvantageEstimator("t_old_names", "group", compute, min_group_size=3)
    assert estimator.min_samples_per_prompt == 3
    # Only the keyword is kept (an InitVar): dataclasses.replace still copies the minimum, without a warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dataclasses.replace(estimator, name="t_copy").min_samples_per_prompt == 3
    register_advantage_estimator(estimator)
    try:
        rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
        with pytest.warns(FutureWarning, match="samples_per_prompt"):
            adv = estimate_advantages(estimator, AdvantageInputs(rewards, rewards, 4))
        # G = 4: [1, 0, 0, 0] - 1/4 and [1, 1, 0, 0] - 1/2.
        torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]))
        # The old keyword set the new attribute: G = 2 is below its 3.
        with pytest.raises(ValueError, match="needs samples_per_prompt >= 3, got 2"):
            estimate_advantages(estimator, AdvantageInputs(rewards, rewards, 2))
    finally:
        unregister_advantage_estimator("t_old_names")


def test_old_and_new_estimator_keyword_that_differ_are_refused():
    with pytest.raises(TypeError, match="pass min_samples_per_prompt= only"):
        AdvantageEstimator("t_both", "group", lambda inputs, stats: inputs.rewards, min_samples_per_prompt=4,
                           min_group_size=3)


def test_new_names_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        estimator = AdvantageEstimator("t_new_names", "group", lambda inputs, stats: inputs.rewards,
                                       min_samples_per_prompt=3)
        assert estimator.min_samples_per_prompt == 3
        assert AdvantageInputs(R, R, 2).samples_per_prompt == 2
