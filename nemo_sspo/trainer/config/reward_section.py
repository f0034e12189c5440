"""``reward``: the reward's name, its settings and the overlong shaping, with the section's own invariants."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nemo_sspo.rewards import REWARD_REGISTRY, MathVerifyOptions
from nemo_sspo.trainer.config.keyed import failed, problems_at_key
from nemo_sspo.trainer.config.options import REWARD_OPTIONS, options_problems

__all__ = ["RewardConfig"]


@dataclass
class RewardConfig:
    """``reward``: the reward's name, its settings and the overlong shaping."""

    name: str = "math_verify"
    """Registered reward (``nemo_sspo.rewards.reward_names()``; a ``plugins`` module may add one):
    ``math_verify`` scores the last ``\\boxed{}`` answer against the gold answer with math-verify (0/1)."""
    options: Any = field(default_factory=MathVerifyOptions)
    """The reward's options: the dataclass it was registered with (math_verify:
    :class:`~nemo_sspo.rewards.MathVerifyOptions`, ``num_workers`` and ``timeout_s``): select the reward as
    a group (``reward=math_verify``) so that its schema applies, then set fields
    (``reward.options.num_workers=8``). A reward registered without one takes a mapping of its own keys
    (``reward.options={tolerance: 0.5}``, given whole) or null."""
    overlong_buffer_len: int = 0
    """DAPO overlong reward shaping (arXiv 2503.14476 eq. 13): responses longer than
    ``rollout.sampling.max_new_tokens - overlong_buffer_len`` tokens get a penalty growing linearly to
    ``overlong_penalty`` at ``rollout.sampling.max_new_tokens``, added to the task reward. 0 disables it.
    Shaping only ranks responses within a group whose task rewards differ: a group whose task rewards
    are all equal (all correct or all wrong) gets advantage 0 and counts in
    ``advantages/zero_variance_group_frac`` however its lengths differ, with or without
    ``rollout.sampling.dynamic_sampling`` (which refills such groups; DAPO filters them by accuracy, so its
    penalty never acts on them either)."""
    overlong_penalty: float = 1.0
    """Largest overlong penalty (the paper's 1.0), read when ``overlong_buffer_len > 0``."""

    def problems(self, key: str) -> list[str]:
        """The reward's name, its options (their type and own checks) and the penalty's sign.

        Args:
            key: the section's key path.

        Returns:
            One message per broken invariant, naming ``key.<field>`` and the fix.
        """
        return [
            *problems_at_key(f"{key}.", lambda: REWARD_REGISTRY.get(self.name)),
            *options_problems(REWARD_OPTIONS, key, self.name, self.options),
            *failed((self.overlong_penalty >= 0, f"{key}.overlong_penalty must be >= 0")),
        ]
