"""Helpers of the ``rollout.placement: separate`` tests: re-splitting the spawned world into training
and rollout ranks, and a rollout rank that dies mid-run."""

import datetime
import os

import torch.distributed as dist

from nemo_sspo.parallel.placement import split_world
from nemo_sspo.trainer.placement import RolloutWorker


def split_spawned_world(rank: int, world_size: int, *, num_rollout_ranks: int = 1, timeout_s: float = 60):
    """The spawned world as a :class:`~nemo_sspo.parallel.placement.WorldSplit` (the last
    ``num_rollout_ranks`` ranks roll out): the launch's process group is destroyed and its store reused."""
    store = dist.distributed_c10d._get_default_store()
    dist.destroy_process_group()
    return split_world(store, rank=rank, world_size=world_size, num_rollout_ranks=num_rollout_ranks,
                       timeout=datetime.timedelta(seconds=timeout_s))


def dies_at_step_two(self, step, version, inner=RolloutWorker._generate_and_send):
    """``RolloutWorker._generate_and_send`` whose process exits (code 17) while generating step 2."""
    if step == 2:
        os._exit(17)
    inner(self, step, version)
