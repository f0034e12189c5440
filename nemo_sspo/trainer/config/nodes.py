"""Hydra's ConfigStore nodes: ``train_schema``, one ``loss/<name>`` per registered loss, one
``data/<source>_schema`` per prompt source, and one ``reward/<name>`` per registered reward and
``rollout/engine/<name>`` per registered rollout engine (with its options dataclass's defaults).
"""

from __future__ import annotations

from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from nemo_sspo.algorithms.losses import get_policy_loss, policy_loss_names
from nemo_sspo.data import SOURCE_OPTIONS
from nemo_sspo.trainer.config.data_section import DataConfig
from nemo_sspo.trainer.config.loss_section import LossSection
from nemo_sspo.trainer.config.options import OPTION_SECTIONS
from nemo_sspo.trainer.config.train_config import schema

__all__ = ["register_config_nodes"]


def _store_group(store: ConfigStore, group: str, nodes: dict[str, Any]) -> None:
    """Stores ``nodes`` (name -> node) as the group ``group``, first deleting the nodes of names no
    longer registered (plug-ins, tests), so that no stale choice is left behind.
    """
    repo = store.repo
    for part in group.split("/"):
        repo = repo.get(part, {})
    for stale in [key for key in repo if key.endswith(".yaml") and key.removesuffix(".yaml") not in nodes]:
        del repo[stale]
    for name, node in nodes.items():
        store.store(group=group, name=name, node=node)  # package: the group's path (rollout.engine)


def register_config_nodes() -> None:
    """Store ``train_schema``; one node ``loss/<name>`` per registered loss (its config dataclass's
    defaults; Hydra lists each loss once); one ``data/<source>_schema`` per prompt source; and one
    ``reward/<name>`` per registered reward and ``rollout/engine/<name>`` per registered rollout engine,
    which sets the name and the options: the dataclass the builder was registered with (its defaults;
    a field without one is left to be set), or null for a builder registered without one. The
    reward's and engine's other keys are not in the node, so selecting one changes nothing else.

    Called on import and again by :func:`nemo_sspo.cli.load_config` after the ``plugins`` are
    imported, so that their losses, rewards and engines are selectable too (storing a node again
    replaces it).
    """
    store = ConfigStore.instance()
    store.store(name="train_schema", node=schema())
    _store_group(store, "loss", {name: LossSection(name=name, params=get_policy_loss(name).config_cls())
                                 for name in policy_loss_names()})
    for source, options in SOURCE_OPTIONS.items():
        store.store(group="data", name=f"{source}_schema", node=DataConfig(source=source, options=options))
    for section in OPTION_SECTIONS:
        _store_group(store, section.group, {
            name: OmegaConf.create({section.key: name, "options": section.registry.options_of(name)})
            for name in section.registry.names()})
