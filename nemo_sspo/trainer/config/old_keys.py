"""Keys of earlier releases: the error a config that still sets one gets at load
(:data:`RENAMED_KEYS`, refused naming the new key, never read with a changed meaning), and the
translation of a saved ``config.yaml`` written before the change (:func:`upgrade_saved_config`), so
that a checkpoint of an earlier release resumes and its comparison lists only real changes.
"""

from __future__ import annotations

import copy
from typing import Any

from nemo_sspo.algorithms.losses import get_policy_loss

__all__ = ["RENAMED_KEYS", "upgrade_saved_config"]

RENAMED_KEYS = {
    "rollout.tis_cap": "use rollout.correction=token_tis with rollout.correction_cap=C (the same weight "
                       "min(pi_old / pi_rollout, C))",
    "loss.params.smooth_advantages": "DCPO's smooth standardisation is the advantage estimator dcpo_smooth: use "
                                     "advantage.name=dcpo_smooth (true), or leave advantage.name out (false)",
    "loss.params.advantage_std_normalisation": "the std switch is advantage.normalize_std: use "
                                               "advantage.normalize_std=true or false (null = the loss's default)",
}
"""Keys of earlier releases and what replaced them (the error an old config gets at load)."""


def upgrade_saved_config(saved: dict[str, Any]) -> dict[str, Any]:
    """A composed config saved by an earlier release (``config.yaml`` as nested dicts) in today's layout.

    ``loss.params.smooth_advantages: true`` becomes ``advantage.name: dcpo_smooth`` (false is dropped),
    ``loss.params.advantage_std_normalisation`` becomes ``advantage.normalize_std``: null where it
    equals the loss's default (what an old config that never set it saved), else the value.

    Args:
        saved: the saved config; not modified.

    Returns:
        The config in today's layout (a copy; ``saved`` itself when it has no old key).
    """
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
