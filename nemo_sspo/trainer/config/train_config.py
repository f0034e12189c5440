"""The composed config of a run, :class:`TrainConfig` (one field per section), its ``train_schema``
node, and the settings the loss resolves at load.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nemo_sspo.algorithms.losses import get_policy_loss
from nemo_sspo.trainer.config.advantage_section import AdvantageConfig
from nemo_sspo.trainer.config.critic_section import CriticConfig
from nemo_sspo.trainer.config.data_section import DataConfig
from nemo_sspo.trainer.config.eval_section import EvalConfig
from nemo_sspo.trainer.config.keyed import at_key
from nemo_sspo.trainer.config.loss_section import LossSection, build_loss_config
from nemo_sspo.trainer.config.model_section import ModelConfig
from nemo_sspo.trainer.config.optim_section import OptimConfig
from nemo_sspo.trainer.config.options import resolve_options
from nemo_sspo.trainer.config.parallel_section import ParallelConfig
from nemo_sspo.trainer.config.reward_section import RewardConfig
from nemo_sspo.trainer.config.rollout_section import RolloutConfig
from nemo_sspo.trainer.config.trainer_section import TrainerConfig

__all__ = ["SECTIONS", "TrainConfig", "resolve_loss_settings", "resolve_settings", "schema"]


@dataclass
class TrainConfig:
    """A whole run's config: one field per section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossSection = field(default_factory=LossSection)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    plugins: list[str] = field(default_factory=list)
    """Python modules (dotted names on ``sys.path``, or ``.py`` file paths) imported before the config
    is composed, so that the losses, rewards, rollout engines, advantage estimators and prompt sources
    they register can be selected (``plugins=[my_lab.losses] loss=my_loss``); installed packages can
    instead declare an entry point in the group ``nemo_sspo.plugins`` (:mod:`nemo_sspo.trainer.plugins`)."""
    entry_point_plugins: list[str] = field(default_factory=list)
    """Recorded, not chosen: the entry points of the group ``nemo_sspo.plugins`` that
    :func:`nemo_sspo.cli.load_config` imported, as ``"<name> = <module> (<distribution> <version>)"``,
    so that the run's ``config.yaml`` names the installed plugins it ran with. A value given (e.g.
    from an earlier run's ``config.yaml``) must equal what is installed now."""



SECTIONS = ("model", "parallel", "data", "rollout", "reward", "optim", "loss", "trainer", "eval", "critic",
            "advantage")
"""The fields of :class:`TrainConfig` that are sections (each with its ``problems``), in order."""


def schema() -> TrainConfig:
    """The ``train_schema`` node: :class:`TrainConfig` with ``loss.params``, ``data.options``,
    ``reward.options`` and ``rollout.engine.options`` left open (None), so that the selected group's
    dataclass fills them instead of being merged into the defaults' SSPO / word-problem / math-verify
    dataclasses (OmegaConf refuses to merge one dataclass into another).

    Returns:
        The node's config.
    """
    cfg = TrainConfig(data=DataConfig(options=None), loss=LossSection(params=None), reward=RewardConfig(options=None))
    cfg.rollout.engine.options = None
    return cfg


def resolve_loss_settings(cfg: TrainConfig) -> None:
    """Fill the settings left null for the loss to decide (``rollout.sampling.dynamic_sampling``,
    ``advantage.name``), in place.

    Args:
        cfg: the composed config.

    Raises:
        ValueError: unknown ``loss.name`` (lists the registered ones).
    """
    if cfg.rollout.sampling.dynamic_sampling is None or cfg.advantage.name is None:
        record = at_key("loss.", lambda: get_policy_loss(cfg.loss.name))
        needs = record.requirements(build_loss_config(cfg.loss))
        if cfg.rollout.sampling.dynamic_sampling is None:
            cfg.rollout.sampling.dynamic_sampling = needs.dynamic_sampling
        if cfg.advantage.name is None:
            cfg.advantage.name = "critic" if needs.advantage_source == "critic" else "group"


def resolve_settings(cfg: TrainConfig) -> None:
    """Fill, in place, every setting a composed config leaves to be resolved before it is checked: the
    loss's (:func:`resolve_loss_settings`), then the reward's and engine's options
    (:func:`~nemo_sspo.trainer.config.options.resolve_options`).

    Args:
        cfg: the composed config.

    Raises:
        ValueError: unknown ``loss.name`` (lists the registered ones).
    """
    resolve_loss_settings(cfg)
    resolve_options(cfg)
