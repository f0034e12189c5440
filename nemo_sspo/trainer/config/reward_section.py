"""``reward``: the reward's name, its settings and the overlong shaping, with the section's own invariants."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nemo_sspo.rewards import REWARD_REGISTRY
from nemo_sspo.trainer.config.keyed import failed, problems_at_key

__all__ = ["RewardConfig"]


@dataclass
class RewardConfig:
    """``reward``: the reward's name, its settings and the overlong shaping."""

    name: str = "math_verify"
    """Registered reward (``nemo_sspo.rewards.reward_names()``; a ``plugins`` module may add one):
    ``math_verify`` scores the last ``\\boxed{}`` answer against the gold answer with math-verify (0/1)."""
    options: Any = None
    """Settings of a user reward as one mapping, read by its builder (``reward.options={tolerance: 0.5}``,
    given whole); null for none. math_verify reads none."""
    num_workers: int = 2
    """math_verify: processes scoring answers (its timeouts need each worker's main thread)."""
    timeout_s: float = 5.0
    """math_verify: per-answer verification limit in seconds; a timeout scores 0."""
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
        """The reward's name, its workers and the penalty's sign.

        Args:
            key: the section's key path.

        Returns:
            One message per broken invariant, naming ``key.<field>`` and the fix.
        """
        return [
            *problems_at_key(f"{key}.", lambda: REWARD_REGISTRY.get(self.name)),
            *failed(
                (self.num_workers >= 1, f"{key}.num_workers must be >= 1"),
                (self.overlong_penalty >= 0, f"{key}.overlong_penalty must be >= 0"),
            ),
        ]
