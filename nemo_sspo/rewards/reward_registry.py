"""Name -> reward builder registry: the trainer picks its reward by ``reward.name``.

A reward is any object with the :class:`Reward` interface (a callable over decoded responses and
gold answers, and ``close``). It is registered as a *builder* that receives the ``reward`` config
section, so it can read its settings in ``reward.options``: an instance of the options dataclass the
reward was registered with (``math_verify``: :class:`MathVerifyOptions`), or, for a reward registered
without one, a mapping of its own keys or None. ``math_verify`` (the default) is registered here; a
user module registers its own and is named by the config key ``plugins``.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from nemo_sspo.registry import BuilderRegistry
from nemo_sspo.rewards.math_reward import MathVerifyOptions, MathVerifyReward

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


REWARD_REGISTRY: BuilderRegistry[Any, Reward] = BuilderRegistry("reward")
"""``reward.name`` -> builder ``build(section) -> Reward`` (``section``: the run's ``reward`` config).

The public functions below are its methods, so the rules and messages are the registry's
(:mod:`nemo_sspo.registry`):

- ``register_reward(name, build, options=None) -> build``: ``reward.name=<name>`` builds with
  ``build``; ``options``, a dataclass, is the schema of ``reward.options`` (the group ``reward=<name>``
  selects it with its defaults; None: an untyped mapping or None). ``ValueError`` if the name is taken,
  ``TypeError`` if ``options`` is not a dataclass type.
- ``unregister_reward(name) -> build``: removes it (tests and plug-ins that register temporarily);
  ``ValueError`` for an unknown name.
- ``reward_names() -> list[str]``: the sorted registered names.
- ``build_reward(name, section) -> Reward``: the reward built from the ``reward`` config section;
  ``ValueError`` for an unknown name (listing the registered ones) or from the builder's checks.
"""

register_reward = REWARD_REGISTRY.add
unregister_reward = REWARD_REGISTRY.remove
reward_names = REWARD_REGISTRY.names
build_reward = REWARD_REGISTRY.build

register_reward("math_verify", lambda section: MathVerifyReward(num_workers=section.options.num_workers,
                                                                timeout_s=section.options.timeout_s),
                options=MathVerifyOptions)
