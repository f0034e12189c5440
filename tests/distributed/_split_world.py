"""Set-ups the ``rollout.schedule.placement: separate`` tests share (imported by the spawned children).

- :func:`resplit`: the spawned world (``run_distributed``'s gloo group) re-launched as a split world
  of training and rollout ranks over the same rendezvous store;
- :func:`fit_side`: one separate run, each rank on its side (the rollout rank serves, the training
  rank trains and returns its history and final policy);
- :func:`dies_at_step`: a rollout worker that kills its process while generating a given step.
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

from nemo_sspo.parallel.world_split import WorldSplit, split_world


def resplit(rank: int, world_size: int, num_rollout_ranks: int, timeout_s: float, *, prefix: str | None = None,
            store=None) -> WorldSplit:
    """Ends this process's default group and joins the split world (collective over every rank).

    ``store``: the rendezvous store (default: the launch's, kept alive by this reference); ``prefix``
    namespaces a second split over the same store.
    """
    store = store if store is not None else dist.distributed_c10d._get_default_store()
    if dist.is_initialized():
        dist.destroy_process_group()
    if prefix is not None:
        store = dist.PrefixStore(prefix, store)
    return split_world(store, rank=rank, world_size=world_size, num_rollout_ranks=num_rollout_ranks,
                       timeout=datetime.timedelta(seconds=timeout_s))


def fit_side(cfg, split: WorldSplit, checkpoint, reward, *, run=None):
    """One separate run: a rollout rank serves it and returns None; a training rank returns
    ``run(trainer)`` (default: ``(history, final HF-named policy)``), its Megatron state torn down after.
    """
    from nemo_sspo.megatron import destroy_parallel, export_hf_state_dict
    from nemo_sspo.trainer import loop, setup

    if split.is_rollout:
        setup.run_rollout_rank(cfg, split, checkpoint=checkpoint, reward=reward)
        return None
    trainer = loop.GRPOTrainer(cfg, setup.start_parallel(cfg.parallel, cfg.trainer.seed), checkpoint=checkpoint,
                               reward=reward, split=split)
    try:
        if run is not None:
            return run(trainer)
        history = trainer.fit()
        return history, export_hf_state_dict(trainer.model.module, trainer.hf_config)
    finally:
        destroy_parallel()


def dies_at_step(step: int, code: int = 17):
    """A replacement for ``RolloutWorker._generate_and_send`` that exits the process with ``code``
    (no clean-up, as a crash) when asked to generate ``step``."""
    from nemo_sspo.rollouts.worker import RolloutWorker

    inner = RolloutWorker._generate_and_send

    def generate_and_send(self, at_step, version):
        if at_step == step:
            os._exit(code)
        inner(self, at_step, version)
    return generate_and_send
