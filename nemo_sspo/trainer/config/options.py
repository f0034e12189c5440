"""The ``options`` of the sections that name a registered builder, ``reward`` (``reward.name``) and
``rollout.engine`` (``rollout.engine.backend``): typed by the options dataclass the builder was
registered with (:class:`~nemo_sspo.registry.BuilderRegistry`), selected as a group (``reward=<name>``,
``rollout/engine=<name>``, nodes of :mod:`~nemo_sspo.trainer.config.nodes`), filled with that
dataclass's defaults where a config names the builder without selecting its group
(:func:`resolve_options`), and checked by type and by the dataclass's own ``problems``
(:func:`options_problems`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from nemo_sspo.registry import BuilderRegistry
from nemo_sspo.rewards import REWARD_REGISTRY
from nemo_sspo.rollout import ROLLOUT_ENGINE_REGISTRY
from nemo_sspo.trainer.config.keyed import failed

__all__ = ["ENGINE_OPTIONS", "OPTION_SECTIONS", "REWARD_OPTIONS", "OptionsSection", "options_problems",
           "resolve_options"]


@dataclass(frozen=True)
class OptionsSection:
    """A config section whose ``options`` belong to the builder it names.

    Attributes:
        path: the section's key path (``rollout.engine``).
        key: its field naming the builder (``backend``).
        group: the Hydra group selecting a builder with its options (``rollout/engine``).
        noun: what a builder is, for messages (``engine``).
        registry: the builders and their options dataclasses.
    """

    path: str
    key: str
    group: str
    noun: str
    registry: BuilderRegistry


REWARD_OPTIONS = OptionsSection("reward", "name", "reward", "reward", REWARD_REGISTRY)
"""``reward.options``: the options of the reward ``reward.name``."""
ENGINE_OPTIONS = OptionsSection("rollout.engine", "backend", "rollout/engine", "engine", ROLLOUT_ENGINE_REGISTRY)
"""``rollout.engine.options``: the options of the rollout engine ``rollout.engine.backend``."""
OPTION_SECTIONS = (REWARD_OPTIONS, ENGINE_OPTIONS)
"""Every section whose ``options`` are typed by its builder's registration."""


def _defaults(cls: type) -> Any:
    """``cls()``, or None when a field has no default (its group node then leaves it to be set)."""
    try:
        return cls()
    except TypeError:
        return None


def options_problems(section: OptionsSection, key: str, name: str, options: Any) -> list[str]:
    """The options' type against the builder ``name``, then the options' own ``problems`` (if the
    dataclass has that method).

    Args:
        section: the section.
        key: the section's key path.
        name: the builder it names (an unknown one has no problems here: the section names it).
        options: the section's ``options``.

    Returns:
        One message per problem, naming ``key.options`` (or ``key.options.<field>``) and the fix.
    """
    if name not in section.registry:
        return []
    declared = section.registry.options_of(name)
    fix = (f"select the {section.noun} as a group ({section.group}={name}) instead of setting "
           f"{key}.{section.key}, then set its fields ({key}.options.<field>=...)")
    if declared is None:
        return failed((options is None or isinstance(options, dict),
                       f"{key}.{section.key}={name!r} takes {key}.options as a mapping or null (it was registered "
                       f"without an options dataclass), got {type(options).__name__}: {fix}"))
    if type(options) is not declared:
        return [f"{key}.{section.key}={name!r} needs {key}.options of type {declared.__name__}, got "
                f"{type(options).__name__}: {fix}"]
    return options.problems(f"{key}.options") if hasattr(options, "problems") else []


def resolve_options(cfg: Any) -> None:
    """Fill the ``options`` of each of :data:`OPTION_SECTIONS` that its group did not, in place.

    So a config naming a builder without selecting its group (``reward.name: math_verify``,
    ``rollout.engine.backend=vllm``, ``rollout.engine.backend=hf`` over a vLLM recipe) means what it did
    before options were typed, when each builder's settings had their own keys:

    - options null, the builder declaring a dataclass: that dataclass's defaults (left null when a
      field has no default: :func:`options_problems` then names the group to select);
    - options of another builder's dataclass (the group a config selected, its name then overridden:
      ``reward.name=my_reward`` over ``reward: math_verify``), which the named builder never read:
      null for a builder without a dataclass; that dataclass's defaults if the other builder's options
      are at their defaults too. Settings made for another builder are not carried over to a builder
      with its own dataclass: they stay, and :func:`options_problems` refuses them naming the group.

    Args:
        cfg: the composed config (:class:`~nemo_sspo.trainer.config.TrainConfig`).
    """
    for section in OPTION_SECTIONS:
        node = functools.reduce(getattr, section.path.split("."), cfg)
        name = getattr(node, section.key)
        if name not in section.registry:
            continue  # the section's problems name it
        declared, options = section.registry.options_of(name), node.options
        other = type(options) in set(section.registry.declared_options().values()) - {declared}
        if declared is None:
            if other:
                node.options = None
        elif options is None or (other and options == _defaults(type(options))):
            node.options = _defaults(declared)
