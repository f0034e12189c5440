"""A ``plugins=[...]`` module for CLI runs (tests/integration/test_train_loop.py): registers
``test_alternating``, a reward of 1, 0, 1, 0, ... by position in the scoring call.

The sampler scores a round's groups in one call, each group's responses back to back
(nemo_sspo/rollouts/sampling.py), so with an even ``rollout.samples_per_prompt`` every group scores
half 1s and half 0s whatever the (random) model wrote: rewards, accuracy and advantages known by hand.
"""

from nemo_sspo.rewards import register_reward

REWARD = "test_alternating"


class AlternatingReward:
    """1.0 for the responses at even positions of a call, 0.0 for the odd ones."""

    def __call__(self, responses, answers):
        return [float(i % 2 == 0) for i in range(len(responses))]

    def close(self):
        pass


register_reward(REWARD, lambda section: AlternatingReward())
