"""Name -> reward builder registry: the trainer picks its reward by ``reward.name``.

A reward is any object with the :class:`Reward` interface (a callable over decoded responses and
gold answers, and ``close``). It is registered as a *builder* that receives the ``reward`` config
section, so it can read its settings (``num_workers`` for math-verify; a user reward reads
``reward.options``, a mapping of its own keys, or None). ``math_verify`` (the default) is registered
here; a user module registers its own and is named by the config key ``plugins``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from nemo_sspo.registry import Registry
from nemo_sspo.rewards.math_reward import MathVerifyReward

__all__ = ["REWARD_REGISTRY", "Reward", "build_reward", "register_reward", "reward_names", "unregister_reward"]


@runtime_checkable
class Reward(Protocol):
    """Scores a batch of responses: ``reward(responses, answers) -> list[float]``."""

    def __call__(self, responses: list[str], answers: list[str]) -> list[float]:
        """One finite float per response, scored against ``answers[i]`` (its problem's gold answer).

        Args:
            responses: decoded responses (special tokens removed), one per rollout row.
            answers: the gold answer of each row's problem (repeated G times per group).
        """
        ...

    def close(self) -> None:
        """Release workers or other resources (called once when the trainer stops)."""
        ...


RewardBuilder = Callable[[Any], Reward]
"""``build(reward_section) -> Reward``, with ``reward_section`` the run's ``reward`` config."""

REWARD_REGISTRY: Registry[RewardBuilder] = Registry(
    "reward", hint=" (a module that registers one is loaded with the config key plugins)")


def register_reward(name: str, build: RewardBuilder) -> RewardBuilder:
    """Make ``reward.name=<name>`` build its reward with ``build``; returns ``build``.

    Raises:
        ValueError: the name is taken.
    """
    return REWARD_REGISTRY.add(name, build)


def unregister_reward(name: str) -> RewardBuilder:
    """Remove and return the builder of ``name`` (tests and plug-ins that register temporarily).

    Raises:
        ValueError: unknown name.
    """
    return REWARD_REGISTRY.remove(name)


def reward_names() -> list[str]:
    """Sorted names of the registered rewards."""
    return REWARD_REGISTRY.names()


def build_reward(name: str, section: Any) -> Reward:
    """The reward registered as ``name``, built from the ``reward`` config ``section``.

    Raises:
        ValueError: unknown ``name``, or the builder's own checks.
    """
    return REWARD_REGISTRY.get(name)(section)


register_reward("math_verify", lambda section: MathVerifyReward(num_workers=section.num_workers,
                                                                timeout_s=section.timeout_s))
