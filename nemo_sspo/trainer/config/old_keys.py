"""Keys of earlier releases: the error a config that still sets one gets at load
(:data:`RENAMED_KEYS`, refused naming the new key, never read with a changed meaning), and the
translation of a saved ``config.yaml`` written before the change (:func:`upgrade_saved_config`), so
that a checkpoint of an earlier release resumes and its comparison lists only real changes. The keys
that only moved (:data:`MOVED_KEYS`) give both from the one table.
"""

from __future__ import annotations

import copy
from dataclasses import fields, is_dataclass
from typing import Any, get_type_hints

from nemo_sspo.algorithms.losses import get_policy_loss
from nemo_sspo.trainer.config.options import OPTION_SECTIONS, OptionsSection
from nemo_sspo.trainer.config.train_config import TrainConfig

__all__ = ["MOVED_INTO_OPTIONS", "MOVED_KEYS", "RENAMED_KEYS", "upgrade_saved_config"]

MOVED_KEYS = {
    "rollout.max_new_tokens": "rollout.sampling.max_new_tokens",
    "rollout.temperature": "rollout.sampling.temperature",
    "rollout.top_p": "rollout.sampling.top_p",
    "rollout.dynamic_sampling": "rollout.sampling.dynamic_sampling",
    "rollout.max_sampling_rounds": "rollout.sampling.max_sampling_rounds",
    "rollout.backend": "rollout.engine.backend",
    "rollout.vllm": "rollout.engine.options",
    "rollout.engine.vllm": "rollout.engine.options",
    "rollout.engine_options": "rollout.engine.options",
    "rollout.refit_bucket_mb": "rollout.refit.bucket_mb",
    "rollout.verify_refit": "rollout.refit.verify",
    "rollout.correction": "rollout.correction.name",
    "rollout.correction_cap": "rollout.correction.cap",
    "rollout.correction_low": "rollout.correction.low",
    "rollout.correction_high": "rollout.correction.high",
    "rollout.placement": "rollout.schedule.placement",
    "rollout.num_ranks": "rollout.schedule.num_ranks",
    "rollout.peer_timeout_s": "rollout.schedule.peer_timeout_s",
    "rollout.max_staleness": "rollout.schedule.max_staleness",
    "rollout.staleness_schedule": "rollout.schedule.mode",
    "rollout.stale_policy": "rollout.schedule.stale_policy",
    "rollout.partial": "rollout.schedule.partial",
    "reward.num_workers": "reward.options.num_workers",
    "reward.timeout_s": "reward.options.timeout_s",
}
"""Keys of earlier releases that moved unchanged (the same values, the same meaning) -> today's key; a
moved section (``rollout.engine.vllm``) takes its keys along."""

MOVED_INTO_OPTIONS = {
    "rollout.vllm": "vllm",
    "rollout.engine.vllm": "vllm",
    "reward.num_workers": "math_verify",
    "reward.timeout_s": "math_verify",
}
"""The moved keys whose new home is a builder's typed ``options`` (``rollout.engine.options``,
``reward.options``) -> the builder that alone read them: their keys are its options dataclass's, the
load-time message names its group, and a saved config keeps them only where it names that builder."""


def _options_section(new: str) -> OptionsSection | None:
    """The section of :data:`~nemo_sspo.trainer.config.options.OPTION_SECTIONS` whose ``options`` hold
    today's key ``new``, or None.
    """
    return next((s for s in OPTION_SECTIONS if f"{new}.".startswith(f"{s.path}.options.")), None)


def _node(path: str, owner: str | None = None) -> Any:
    """The type of today's key ``path`` (a section's dataclass, or a value's type); a builder's
    ``options`` are ``owner``'s options dataclass (``Any`` without an owner).
    """
    node: Any = TrainConfig
    section = _options_section(path) if owner is not None else None
    for depth, part in enumerate(path.split("."), 1):
        if section is not None and ".".join(path.split(".")[:depth]) == f"{section.path}.options":
            node = section.registry.options_of(owner)
        else:
            node = get_type_hints(node)[part]
    return node


def _moved_messages() -> dict[str, str]:
    """``{old key: "<old> moved to <new>"}`` for each moved key, and each key of a moved section; a key
    moved into a builder's options adds the group that selects them.
    """
    messages = {}
    for old, new in MOVED_KEYS.items():
        owner = MOVED_INTO_OPTIONS.get(old)
        node = _node(new, owner)
        below = [f".{f.name}" for f in fields(node)] if is_dataclass(node) else []
        section = _options_section(new)
        hint = f" (select the group {section.group}={owner})" if owner is not None and section else ""
        for tail in ["", *below]:
            messages[old + tail] = f"{old + tail} moved to {new + tail}{hint}"
    return messages


RENAMED_KEYS = {
    "rollout.tis_cap": "rollout.tis_cap was removed: use rollout.correction.name=token_tis with "
                       "rollout.correction.cap=C (the same weight min(pi_old / pi_rollout, C))",
    "loss.params.smooth_advantages": "loss.params.smooth_advantages was removed: DCPO's smooth standardisation is "
                                     "the advantage estimator dcpo_smooth: use advantage.name=dcpo_smooth (true), "
                                     "or leave advantage.name out (false)",
    "loss.params.advantage_std_normalisation": "loss.params.advantage_std_normalisation was removed: the std switch "
                                               "is advantage.normalize_std: use advantage.normalize_std=true or "
                                               "false (null = the loss's default)",
    **_moved_messages(),
}
"""Keys of earlier releases -> the error an old config that sets one gets at load, naming what replaced it."""


def _pop_old(config: dict[str, Any], old: str, new: str) -> tuple[bool, Any]:
    """``(True, value)`` with the old key's value taken out of ``config``, or ``(False, None)`` when
    ``config`` does not hold it (or holds today's section of the same name: ``rollout.correction``).
    """
    *parents, last = old.split(".")
    node: Any = config
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict) or last not in node:
        return False, None
    if new.startswith(f"{old}.") and isinstance(node[last], dict):
        return False, None
    return True, node.pop(last)


def _names_owner(config: dict[str, Any], new: str, owner: str) -> bool:
    """Whether ``config`` names ``owner`` as the builder whose options hold ``new``."""
    section = _options_section(new)
    node: Any = config
    for part in section.path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return isinstance(node, dict) and node.get(section.key) == owner


def _moved(saved: dict[str, Any]) -> dict[str, Any]:
    """``saved`` with each of :data:`MOVED_KEYS` that it holds under its new key (a copy when any).

    The keys of :data:`MOVED_INTO_OPTIONS` go last (over an old untyped ``rollout.engine_options``)
    and only where the config names their builder; for another builder, which never read them, they
    are dropped (its options stay as saved).
    """
    upgraded = copy.deepcopy(saved)
    taken = [(old, new, value) for old, new in MOVED_KEYS.items()
             for found, value in [_pop_old(upgraded, old, new)] if found]
    if not taken:
        return saved
    for old, new, value in sorted(taken, key=lambda item: item[0] in MOVED_INTO_OPTIONS):
        owner = MOVED_INTO_OPTIONS.get(old)
        if owner is not None and not _names_owner(upgraded, new, owner):
            continue
        *parents, last = new.split(".")
        node = upgraded
        for part in parents:
            if node.get(part) is None:  # absent, or the null options of a builder that read none
                node[part] = {}
            node = node[part]
        node[last] = value
    return upgraded


def upgrade_saved_config(saved: dict[str, Any]) -> dict[str, Any]:
    """A composed config saved by an earlier release (``config.yaml`` as nested dicts) in today's layout.

    Each of :data:`MOVED_KEYS` goes to its new key with its value (the flat ``rollout`` section into
    its sub-sections; math_verify's ``reward.num_workers`` / ``timeout_s`` and the vllm engine's section
    into their ``options`` where the config names that reward / engine, else dropped); ``loss.params.smooth_advantages: true`` becomes ``advantage.name: dcpo_smooth``
    (false is dropped), ``loss.params.advantage_std_normalisation`` becomes ``advantage.normalize_std``:
    null where it equals the loss's default (what an old config that never set it saved), else the value.

    Args:
        saved: the saved config; not modified.

    Returns:
        The config in today's layout (a copy; ``saved`` itself when it has no old key).
    """
    saved = _moved(saved)
    params = (saved.get("loss") or {}).get("params") or {}
    if "smooth_advantages" not in params and "advantage_std_normalisation" not in params:
        return saved
    upgraded = copy.deepcopy(saved)
    params, advantage = upgraded["loss"]["params"], upgraded.setdefault("advantage", {})
    if params.pop("smooth_advantages", False):
        advantage["name"] = "dcpo_smooth"
    if "advantage_std_normalisation" in params:
        value = params.pop("advantage_std_normalisation")
        try:
            default = get_policy_loss(upgraded["loss"].get("name")).normalize_std
        except ValueError:  # a loss no longer registered: keep the value as it was set
            default = None
        advantage["normalize_std"] = None if value == default else value
    return upgraded
