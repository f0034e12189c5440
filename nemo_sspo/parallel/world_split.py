"""One launched world split into training ranks and rollout ranks (``rollout.schedule.placement: separate``).

torchrun (or Slurm) starts one world of N processes with one rendezvous. The last R of them
(``rollout.schedule.num_ranks``) become rollout ranks, the first N - R training ranks. Each side gets a
default process group of its own, so Megatron's parallel state on the training ranks sees a world
of N - R ranks (TP x PP x DP as in a colocated run) and never waits for a rollout rank. Dedicated
groups join the sides, built from the same rendezvous store under their own prefixes:

- ``bridge``: every rank, world rank numbering, for point-to-point tensors between the sides;
- ``refit``: training rank 0 (the trainer's export rank) and the rollout ranks, group rank 0 being
  training rank 0 and rollout rank j being ``1 + j``, for the weight broadcast
  (:mod:`nemo_sspo.parallel.weight_broadcast`). Other training ranks are not in it;
- ``pairs``: for each rollout rank j, a gloo group of training rank 0 (group rank 0) and rollout
  rank j (group rank 1), for the free-running version notices
  (:mod:`nemo_sspo.parallel.version_notice`, which rely on gloo's asynchronous collectives being
  polled with ``is_completed()`` on host tensors) and weights. One group per rollout rank, because
  gloo relays a broadcast through its receivers: over one group of all rollout ranks, a rank that
  wants the new weights between two rollouts waits until the others stop generating to join.

The bridge is always a gloo group over host tensors (rollouts are small, and the free-running
collector receives from any source, which NCCL lacks). The refit group takes ``refit_backend``:
``nccl`` keeps the weight buckets on the GPUs (export, broadcast and load), ``gloo`` sends them
through host memory. Every collective of these groups has the split's timeout, so a rollout rank
that dies or hangs makes the other side's call fail after at most ``timeout`` instead of waiting
forever.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["WorldSplit", "split_launched_world", "split_world"]


@dataclass(frozen=True)
class WorldSplit:
    """This process's place in a split world (module docstring).

    Attributes:
        rank: rank in the launched world.
        world_size: N, processes launched.
        num_rollout_ranks: R >= 1, the last R world ranks (the setting ``rollout.schedule.num_ranks``).
        bridge: gloo group of all N ranks (ranks as in the launched world).
        refit: group (gloo or NCCL, :func:`split_world`'s ``refit_backend``) of training rank 0 and
            the rollout ranks, or None on the other training ranks.
        pairs: rollout index j -> gloo group of training rank 0 and rollout rank j: every j on
            training rank 0, its own on a rollout rank, none on the other training ranks.
    """

    rank: int
    world_size: int
    num_rollout_ranks: int
    bridge: dist.ProcessGroup
    refit: dist.ProcessGroup | None
    pairs: dict[int, dist.ProcessGroup]

    @property
    def num_training_ranks(self) -> int:
        """N - R, the world Megatron sees."""
        return self.world_size - self.num_rollout_ranks

    @property
    def is_rollout(self) -> bool:
        """Whether this process is a rollout rank."""
        return self.rank >= self.num_training_ranks

    def rollout_index(self, rank: int) -> int:
        """Index j in 0..R-1 of world rank ``rank`` among the rollout ranks.

        Raises:
            ValueError: ``rank`` is a training rank.
        """
        if not self.num_training_ranks <= rank < self.world_size:
            raise ValueError(f"world rank {rank} is not a rollout rank (those are {self.num_training_ranks}.."
                             f"{self.world_size - 1})")
        return rank - self.num_training_ranks


def split_world(store: dist.Store, *, rank: int, world_size: int, num_rollout_ranks: int,
                timeout: datetime.timedelta, backend: str = "gloo", refit_backend: str = "gloo") -> WorldSplit:
    """Initialises this side's default process group and the groups between the sides.

    Collective over the whole launched world (every rank must call it with the same arguments).

    Args:
        store: the launch's rendezvous store (e.g. a ``TCPStore`` client of torchrun's
            ``MASTER_ADDR:MASTER_PORT``); each group uses it under its own prefix.
        rank: this process's rank in the launched world.
        world_size: N, processes launched.
        num_rollout_ranks: R, the last R ranks become rollout ranks; 1 <= R < N.
        timeout: limit of every collective of the new groups (how long a dead or hung peer can
            block the other side).
        backend: the default groups' backend (``gloo`` on CPU, ``nccl`` with GPUs).
        refit_backend: the refit group's backend: ``gloo``, or ``nccl`` (every member has a GPU, its
            current CUDA device set; the weight buckets then stay on the GPUs).

    Returns:
        This rank's :class:`WorldSplit`.

    Raises:
        ValueError: R outside [1, N), ``rank`` outside [0, N), a default process group that already
            exists, a ``refit_backend`` other than gloo / nccl, or nccl without CUDA.
    """
    if not 1 <= num_rollout_ranks < world_size:
        raise ValueError(f"num_rollout_ranks={num_rollout_ranks} must be in [1, world_size={world_size}): "
                         "at least one rollout rank and one training rank")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    if dist.is_initialized():
        raise ValueError("split_world needs a process without a default process group (call it instead of "
                         "init_process_group)")
    if refit_backend not in ("gloo", "nccl"):
        raise ValueError(f"refit_backend={refit_backend!r} must be 'gloo' or 'nccl'")
    if refit_backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("refit_backend='nccl' needs CUDA on every member of the refit group; use 'gloo'")
    training = world_size - num_rollout_ranks
    is_rollout = rank >= training
    side = "rollout" if is_rollout else "train"
    dist.init_process_group(backend, store=dist.PrefixStore(f"nemo_sspo/{side}", store),
                            rank=rank - training if is_rollout else rank,
                            world_size=num_rollout_ranks if is_rollout else training, timeout=timeout)
    bridge = dist.ProcessGroupGloo(dist.PrefixStore("nemo_sspo/bridge", store), rank, world_size, timeout)
    refit, pairs = None, {}
    if is_rollout or rank == 0:
        refit_rank, members = 1 + rank - training if is_rollout else 0, 1 + num_rollout_ranks
        refit = (dist.ProcessGroupGloo if refit_backend == "gloo" else _nccl_group)(
            dist.PrefixStore(f"nemo_sspo/refit_{refit_backend}", store), refit_rank, members, timeout)
        for j in [rank - training] if is_rollout else range(num_rollout_ranks):
            pairs[j] = dist.ProcessGroupGloo(dist.PrefixStore(f"nemo_sspo/pair{j}", store), int(is_rollout), 2,
                                             timeout)
    return WorldSplit(rank=rank, world_size=world_size, num_rollout_ranks=num_rollout_ranks,
                      bridge=bridge, refit=refit, pairs=pairs)


def _nccl_group(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta):
    """An NCCL group of ``size`` members over ``store`` with ``timeout`` (GPU builds of torch only)."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, options)


def split_launched_world(num_rollout_ranks: int, *, timeout: datetime.timedelta,
                         device_refit: bool = False) -> WorldSplit:
    """:func:`split_world` for a torchrun (or Slurm ``srun`` with the same variables) launch.

    Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``. Under torchrun the agent
    hosts the rendezvous store and every rank connects to it; otherwise rank 0 hosts it. With CUDA
    each process takes GPU ``LOCAL_RANK`` (modulo the GPUs visible) and the default groups use NCCL;
    gloo otherwise. The refit group is NCCL when ``device_refit`` is set and every process of the node
    has a GPU of its own (``LOCAL_WORLD_SIZE`` at most the GPUs visible: NCCL refuses two members on
    one GPU), gloo otherwise.

    Args:
        num_rollout_ranks: R, as :func:`split_world`.
        timeout: as :func:`split_world`.
        device_refit: with CUDA, broadcast the weights over NCCL (``refit_backend='nccl'``); the
            caller sets it where every user of the refit group handles device tensors.

    Raises:
        ValueError: a variable is missing, or as :func:`split_world`.
    """
    missing = [key for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if key not in os.environ]
    if missing:
        raise ValueError(f"a separate rollout placement needs a torchrun launch ({', '.join(missing)} unset): "
                         "start it with torchrun --nproc-per-node=<training ranks + rollout ranks>")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    hosts = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=hosts,
                          timeout=timeout)
    return split_world(store, rank=rank, world_size=world_size, num_rollout_ranks=num_rollout_ranks,
                       timeout=timeout, backend="nccl" if torch.cuda.is_available() else "gloo",
                       refit_backend="nccl" if device_refit and _own_gpu_each(world_size) else "gloo")


def _own_gpu_each(world_size: int) -> bool:
    """Whether CUDA is present and each process on this node has a GPU of its own."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return torch.cuda.is_available() and local <= torch.cuda.device_count()
