"""nemo_sspo.rewards.verl_score.compute_score loaded the way verl 0.9.1 loads a custom reward
(``get_custom_reward_fn`` on the example's config, its ``reward_kwargs`` merged in) and called with
verl's keyword arguments: it scores as our math-verify reward, answers worked out by hand."""

import pytest

from nemo_sspo.rewards import verl_score
from tests.integration.test_verl_adapter import _example_config


def test_verl_loads_our_reward_from_the_example_and_it_scores_boxed_answers(monkeypatch):
    from verl.trainer.ppo.reward import get_custom_reward_fn

    monkeypatch.setattr(verl_score, "_reward", None)  # this test's own pool, closed below
    score = get_custom_reward_fn(_example_config())
    row = {"data_source": "math_l3to5_8k", "ground_truth": "\\frac12",
           "extra_info": {"split": "train", "index": 0, "id": "math_l3to5_8k/0"}}
    try:
        assert score(solution_str="Half of 1 is \\boxed{\\frac{1}{2}}.", **row) == 1.0
        assert score(solution_str="So the answer is \\boxed{0.5}", **row) == 1.0  # equal numerically
        assert score(solution_str="\\boxed{2} at first, then \\boxed{1/3}", **row) == 0.0  # the last box counts
        assert score(solution_str="The answer is 1/2.", **row) == 0.0  # no \boxed{}
        assert (verl_score._reward.num_workers, verl_score._reward.timeout_s) == (8, 5.0)  # the example's kwargs
        with pytest.raises(ValueError, match="num_workers=2, timeout_s=5.0 differ from the pool already started"):
            verl_score.compute_score("math500", "\\boxed{1}", "1", None, num_workers=2)
    finally:
        verl_score._reward.close()
