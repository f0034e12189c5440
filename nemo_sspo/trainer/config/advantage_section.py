"""``advantage``: the registered advantage estimator, with the section's own invariants."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from nemo_sspo.algorithms.advantage_estimators import get_advantage_estimator
from nemo_sspo.algorithms.losses import get_policy_loss
from nemo_sspo.trainer.config.keyed import at_key, problems_at_key

if TYPE_CHECKING:
    from nemo_sspo.trainer.config.train_config import TrainConfig

__all__ = ["AdvantageConfig", "advantage_estimator_name", "advantage_normalize_std"]


@dataclass
class AdvantageConfig:
    """``advantage``: the registered advantage estimator (``nemo_sspo.algorithms.advantage_estimators``) and
    its std switch: every advantage setting of a run.
    """

    name: str | None = None
    """Registered estimator (``advantage_estimator_names()``; a ``plugins`` module may add one):
    ``group`` (GRPO's group-normalised advantage; ``normalize_std`` switches the std, off for Dr. GRPO),
    ``leave_one_out`` (RLOO, arXiv 2402.14740), ``batch_std`` (group mean, std over the optimizer batch:
    REINFORCE++-baseline, arXiv 2501.03262), ``critic`` (SPPO's r - sigmoid(V), trains the critic of
    section ``critic``), ``dcpo_smooth`` (DCPO's smooth standardisation, arXiv 2509.02333 sec. 4.2: each
    prompt's group statistics mixed with those of its earlier visits; the per-prompt history is kept
    in checkpoints). null: as the loss asks, resolved when the config is loaded: ``critic`` for a loss
    whose advantages come from the critic (``loss=sppo``), ``group`` otherwise (``loss=dcpo`` included,
    as DCPO's shipped run: select ``dcpo_smooth`` for the paper's SAS). The estimator's statistics
    (group, optimizer batch or step) are summed over the data-parallel ranks, so its advantages do not
    depend on the data-parallel size, the micro-batches or ``rollout.schedule.placement``."""
    normalize_std: bool | None = None
    """Divide the group-centred rewards by the group std (GRPO) or not (Dr. GRPO: r - mean), read by
    the estimators whose std rule is ``switch`` (``group``, ``dcpo_smooth``); ``batch_std`` needs it
    true, and ``leave_one_out`` / ``critic`` refuse it set (they never divide). null: the loss's
    default (``LossRequirements.normalize_std``: false for ``loss=dr_grpo``, true otherwise)."""

    def problems(self, key: str) -> list[str]:
        """The estimator's name, when one is given (null resolves from the loss; the std switch
        against the estimator is a rule, as the estimator may come from the loss).

        Args:
            key: the section's key path.

        Returns:
            One message per broken invariant, naming ``key.<field>`` and the fix.
        """
        if self.name is None:
            return []
        return problems_at_key(f"{key}.", lambda: get_advantage_estimator(self.name))


def advantage_estimator_name(cfg: TrainConfig) -> str:
    """``advantage.name``, or for null what :func:`~nemo_sspo.trainer.config.resolve_loss_settings`
    resolves it to.

    Args:
        cfg: the run's config.

    Returns:
        The registered estimator's name.

    Raises:
        ValueError: unknown ``loss.name``.
    """
    if cfg.advantage.name is not None:
        return cfg.advantage.name
    record = at_key("loss.", lambda: get_policy_loss(cfg.loss.name))
    return "critic" if record.advantage_source == "critic" else "group"


def advantage_normalize_std(cfg: TrainConfig) -> bool:
    """``advantage.normalize_std``, or for null the loss's default (``LossRequirements.normalize_std``).

    Args:
        cfg: the run's config.

    Returns:
        Whether the estimator divides by a std (read by ``std="switch"`` estimators).

    Raises:
        ValueError: unknown ``loss.name``.
    """
    if cfg.advantage.normalize_std is not None:
        return cfg.advantage.normalize_std
    return at_key("loss.", lambda: get_policy_loss(cfg.loss.name)).normalize_std
