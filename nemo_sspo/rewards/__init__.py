r"""Rewards: math-verify scoring of the last ``\boxed{}`` answer, in a process pool, and the
registry from which the trainer builds its reward by name (``reward.name``).
"""

from nemo_sspo.rewards.math_reward import (
    MathVerifyOptions,
    MathVerifyReward,
    extract_last_boxed,
    parse_gold,
    score_response,
)
from nemo_sspo.rewards.reward_registry import (
    REWARD_REGISTRY,
    Reward,
    build_reward,
    register_reward,
    reward_names,
    unregister_reward,
)

__all__ = [
    "REWARD_REGISTRY",
    "MathVerifyOptions",
    "MathVerifyReward",
    "Reward",
    "build_reward",
    "extract_last_boxed",
    "parse_gold",
    "register_reward",
    "reward_names",
    "score_response",
    "unregister_reward",
]
