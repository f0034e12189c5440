"""``advantage``: the registered advantage estimator, with the section's own invariants."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from nemo_sspo.algorithms.advantage_estimators import get_advantage_estimator
from nemo_sspo.algorithms.losses import get_policy_loss
from nemo_sspo.trainer.config.keyed import at_key, problems_at_key

if TYPE_CHECKING:
    from nemo_sspo.trainer.config.train_config import TrainConfig

__all__ = ["AdvantageConfig", "advantage_estimator_name"]


@dataclass
class AdvantageConfig:
    """``advantage``: the registered advantage estimator (``nemo_sspo.algorithms.advantage_estimators``)."""

    name: str | None = None
    """Registered estimator (``advantage_estimator_names()``; a ``plugins`` module may add one):
    ``group`` (GRPO's group-normalised advantage; ``loss.params.advantage_std_normalisation`` switches
    the std, off for Dr. GRPO), ``leave_one_out`` (RLOO, arXiv 2402.14740), ``batch_std`` (group mean,
    std over the optimizer batch: REINFORCE++-baseline, arXiv 2501.03262), ``critic`` (SPPO's
    r - sigmoid(V), trains the critic of section ``critic``). null: as the loss asks, resolved when
    the config is loaded: ``critic`` for a loss whose advantages come from the critic (``loss=sppo``),
    ``group`` otherwise. ``loss.params.smooth_advantages=true`` (DCPO) needs ``group``: its smooth
    standardisation then takes the group statistics' place. The estimator's statistics (group,
    optimizer batch or step) are summed over the data-parallel ranks, so its advantages do not depend
    on the data-parallel size, the micro-batches or ``rollout.placement``."""


    def problems(self, key: str) -> list[str]:
        """The estimator's name, when one is given (null resolves from the loss).

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
