"""``loss``: the registered policy loss and its config dataclass, with the section's own invariants."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nemo_sspo.algorithms.losses import SSPOLossConfig, get_policy_loss
from nemo_sspo.trainer.config.keyed import at_key, problems_at_key

__all__ = ["LossSection", "build_loss_config"]


@dataclass
class LossSection:
    """``loss``: the registered policy loss and its config dataclass."""

    name: str = "sspo"
    """Registered policy-loss name (``nemo_sspo.algorithms.losses.policy_loss_names()``): sspo (default),
    sspo_fixed_clip, grpo, dr_grpo, dapo, gspo, gspo_token, lpo, dcpo, gmpo, sapo, soft_seq_po, cispo,
    clip_cov, kl_cov, sppo (sequence-level PPO with a critic, see ``critic``), or one registered by a
    module of ``plugins``. Select it as a group (``loss=grpo``): every registered loss has a node
    ``loss/<name>`` made from its config dataclass (:func:`register_config_nodes`), and variants
    are YAML files under ``nemo_sspo/conf/loss/`` (``loss=sspo_7b``)."""
    params: Any = field(default_factory=SSPOLossConfig)
    """That loss's own config dataclass (its schema comes with the group ``loss=<name>``; e.g.
    ``loss.params.gamma``, ``aggregation``, ``segmentation``, ``kl_coef``). The trainer also reads
    ``segmentation`` / ``segment_k`` (segment ids), ``kl_coef`` (> 0 keeps a frozen reference policy)
    and from the loss's record its ``advantage_source`` (``critic``: ``advantage.name`` resolves to
    ``critic``, which trains the SPPO critic) and ``normalize_std`` (the default of
    ``advantage.normalize_std``). The advantage settings are in section ``advantage``."""

    def problems(self, key: str) -> list[str]:
        """The loss's name and its params' type (the params check their own values when built).

        Args:
            key: the section's key path.

        Returns:
            One message per broken invariant, naming ``key.<field>`` and the fix.
        """
        return problems_at_key("", lambda: build_loss_config(self))


def build_loss_config(section: LossSection) -> Any:
    """The loss's config dataclass instance, ``section.params``, checked against ``section.name``.

    Args:
        section: the ``loss`` section.

    Returns:
        ``section.params``.

    Raises:
        ValueError: unknown loss name (lists the registered ones), or ``params`` that are not the
            config dataclass of that loss (``loss.name`` overridden without selecting its group).
    """
    config_cls = at_key("loss.", lambda: get_policy_loss(section.name)).config_cls
    if type(section.params) is not config_cls:
        raise ValueError(f"loss.name={section.name!r} needs loss.params of type {config_cls.__name__}, got "
                         f"{type(section.params).__name__}: select the loss as a group (loss={section.name}) "
                         "instead of setting loss.name")
    return section.params
