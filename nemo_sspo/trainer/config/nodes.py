"""Hydra's ConfigStore nodes: ``train_schema``, one ``loss/<name>`` per registered loss and one
``data/<source>_schema`` per prompt source.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from nemo_sspo.algorithms.losses import get_policy_loss, policy_loss_names
from nemo_sspo.data import SOURCE_OPTIONS
from nemo_sspo.trainer.config.data_section import DataConfig
from nemo_sspo.trainer.config.loss_section import LossSection
from nemo_sspo.trainer.config.train_config import schema

__all__ = ["register_config_nodes"]


def register_config_nodes() -> None:
    """Store ``train_schema``, one node ``loss/<name>`` per registered loss (its config dataclass's
    defaults; Hydra lists each loss once) and one ``data/<source>_schema`` per prompt source.

    Called on import and again by :func:`nemo_sspo.cli.load_config` after the ``plugins`` are
    imported, so that their losses are selectable too (storing a node again replaces it).
    """
    store = ConfigStore.instance()
    store.store(name="train_schema", node=schema())
    names = policy_loss_names()
    for stale in [key for key in store.repo.get("loss", {}) if key.removesuffix(".yaml") not in names]:
        del store.repo["loss"][stale]  # a loss unregistered since (plug-ins, tests): no choice left behind
    for name in names:
        store.store(group="loss", name=name,
                    node=LossSection(name=name, params=get_policy_loss(name).config_cls()))
    for source, options in SOURCE_OPTIONS.items():
        store.store(group="data", name=f"{source}_schema", node=DataConfig(source=source, options=options))

