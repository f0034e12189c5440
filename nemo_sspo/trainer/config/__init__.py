"""Typed configuration of a GRPO-family training run.

Each section is a dataclass in its own module (``model_section``, ``parallel_section``, ``data_section``,
``rollout_section`` with its sub-sections ``rollout.sampling``, ``rollout.engine``, ``rollout.refit``, ``rollout.correction`` and ``rollout.schedule``,
``reward_section``, ``optim_section``, ``loss_section``, ``advantage_section``, ``critic_section``,
``trainer_section`` with the trackers' sections, ``eval_section``), composed into :class:`TrainConfig`
(``train_config``) and registered in Hydra's ConfigStore (``nodes``); the YAML files under ``nemo_sspo/conf/`` are merged onto
``OmegaConf.structured(TrainConfig)``, so a misspelt key or a wrong type fails when the config is
loaded (``unknown_keys`` says which key was meant; ``refused`` finds every such key and value where
OmegaConf stops at the first). Four sections take their schema from the layer
that reads them: ``loss.params`` is the selected loss's own config dataclass (group ``loss``: node
``<name>`` per registered loss), ``data.options`` the selected source's options dataclass (group
``data``: ``<source>_schema``), and ``reward.options`` / ``rollout.engine.options`` the options
dataclass the selected reward / engine was registered with (groups ``reward`` and ``rollout/engine``:
node ``<name>`` per registered one; ``options``), so every loss, source, reward and engine field can be
overridden without Hydra's ``+``.
A setting whose value is one of a fixed set of names is typed with a :class:`~nemo_sspo.choice.Choice`
enum (``rollout.schedule.placement``: :class:`Placement`; the enums the lower layers read live there,
e.g. ``rollout.correction.name``: :class:`~nemo_sspo.algorithms.off_policy.Correction`), so the loader
refuses any other value, listing the valid ones; names that plug-ins extend (``loss.name``,
``rollout.engine.backend``, ``reward.name``, ``advantage.name``, ``data.source``) stay strings checked
against their registries.

What the defaults mean: every default is the CPU demo's setting (``nemo-sspo train`` runs SmolLM2-135M
on generated word problems, one process, about 15 minutes on 2 cores), so ``conf/sspo_smollm2_cpu.yaml``
only selects groups. Sections the demo leaves off keep what their feature needs when it is turned
on: ``eval`` is the paper's benchmark protocol (five benchmarks, greedy, 3,000 tokens),
the vllm engine's options (``rollout/engine=vllm``) a GPU engine. The loss defaults are each method's primary source (the method's definition, not a
run size). The paper-scale settings are in ``conf/recipe/``.

Every default lives in its section's module (or on the loss / source dataclass), once. A section's
own invariants are its ``problems`` method; the invariants across sections are the ordered list
:data:`~nemo_sspo.trainer.config.rules.RULES`. :func:`validate`, which :func:`nemo_sspo.cli.load_config`
runs before any process group exists, runs both and raises one ``ValueError`` listing every problem,
each naming the full key path and the fix.
"""

from nemo_sspo.trainer.config.advantage_section import (
    AdvantageConfig,
    advantage_estimator_name,
    advantage_normalize_std,
)
from nemo_sspo.trainer.config.critic_section import CriticConfig
from nemo_sspo.trainer.config.data_section import DataConfig
from nemo_sspo.trainer.config.eval_section import EvalConfig
from nemo_sspo.trainer.config.keyed import at_key
from nemo_sspo.trainer.config.loss_section import LossSection, build_loss_config
from nemo_sspo.trainer.config.model_section import ModelConfig
from nemo_sspo.trainer.config.nodes import register_config_nodes
from nemo_sspo.trainer.config.optim_section import OptimConfig
from nemo_sspo.trainer.config.options import OPTION_SECTIONS, resolve_options
from nemo_sspo.trainer.config.parallel_section import ParallelConfig, micro_batch_layout
from nemo_sspo.trainer.config.reward_section import RewardConfig
from nemo_sspo.trainer.config.rollout_section import (
    CorrectionConfig,
    EngineConfig,
    Placement,
    RefitConfig,
    RolloutConfig,
    SamplingConfig,
    ScheduleConfig,
    ScheduleMode,
    StalePolicy,
)
from nemo_sspo.trainer.config.rules import R3_ENGINES, RULES
from nemo_sspo.trainer.config.train_config import TrainConfig, resolve_loss_settings, resolve_settings, schema
from nemo_sspo.trainer.config.trainer_section import LOGGERS, MlflowConfig, TrainerConfig, WandbConfig, WandbMode
from nemo_sspo.trainer.config.old_keys import RENAMED_KEYS, upgrade_saved_config
from nemo_sspo.trainer.config.unknown_keys import PEER_NAMES, find_unknown_key, unknown_key_message
from nemo_sspo.trainer.config.validation import check_model_layout, config_error, problems_of, validate

__all__ = [
    "ModelConfig",
    "ParallelConfig",
    "DataConfig",
    "RolloutConfig",
    "SamplingConfig",
    "EngineConfig",
    "RefitConfig",
    "CorrectionConfig",
    "ScheduleConfig",
    "EvalConfig",
    "RewardConfig",
    "OptimConfig",
    "LossSection",
    "AdvantageConfig",
    "CriticConfig",
    "TrainerConfig",
    "TrainConfig",
    "LOGGERS",
    "PEER_NAMES",
    "Placement",
    "R3_ENGINES",
    "RENAMED_KEYS",
    "RULES",
    "ScheduleMode",
    "StalePolicy",
    "WandbConfig",
    "WandbMode",
    "MlflowConfig",
    "validate",
    "check_model_layout",
    "config_error",
    "build_loss_config",
    "find_unknown_key",
    "micro_batch_layout",
    "problems_of",
    "register_config_nodes",
    "resolve_loss_settings",
    "resolve_options",
    "resolve_settings",
    "OPTION_SECTIONS",
    "advantage_estimator_name",
    "advantage_normalize_std",
    "upgrade_saved_config",
    "schema",
    "at_key",
    "unknown_key_message",
]

register_config_nodes()
