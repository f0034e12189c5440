"""Process-group and Megatron parallel-state setup; the one reader of ``parallel_state``.

Rank layout is Megatron's default order (tp-cp-ep-dp-pp): tensor-parallel ranks are adjacent, e.g.
world 4 with TP=2, PP=2 gives TP groups {0,1}, {2,3} and PP groups {0,2}, {1,3}.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from nemo_sspo.megatron.cpu_shims import apply_cpu_shims

if TYPE_CHECKING:  # megatron-core is imported lazily (package docstring)
    from megatron.core.process_groups_config import ProcessGroupCollection

__all__ = ["ParallelGroups", "destroy_parallel", "get_parallel_groups", "initialize_parallel"]

# True while the default process group is one that initialize_parallel created (so that
# destroy_parallel tears it down, but never a group a launcher or test fixture owns).
_OWNS_PROCESS_GROUP = False


PROCESS_GROUPS = ("tp", "pp", "dp", "mp", "ep", "cp")
"""The groups of megatron-core's ``ProcessGroupCollection`` a :class:`ParallelGroups` carries."""


@dataclasses.dataclass(frozen=True)
class ParallelGroups:
    """This rank's tensor-, pipeline-, data-, model-, expert- and context-parallel groups, carried in
    megatron-core's ``ProcessGroupCollection``, with the ranks and sizes derived from them.

    The model-parallel group holds the TP x PP ranks of one data-parallel replica; ``mp_src_rank``
    is its first member's global rank and ``pp_last_rank`` the global rank of this pipeline's last
    stage (the sources of rollout and metric broadcasts). The expert-model-parallel group
    (``ep_group``, size ``ep_size``; 1 for dense models) holds the ranks that split one MoE layer's
    experts: same TP rank and pipeline stage, different data-parallel replicas. The
    context-parallel group (``cp_group``, size ``cp_size``; ``parallel.context_parallel_size``)
    holds the ranks that split each sequence of one replica (same TP rank and stage);
    ``cp_src_rank`` is its first member's global rank. With CP > 1 the data-parallel group is
    Megatron's without CP (replicas), and a replica spans TP x CP x PP ranks.

    Attributes:
        pgs: the ``ProcessGroupCollection`` holding ``tp``, ``pp``, ``dp``, ``mp``, ``ep`` and ``cp``
            (what megatron-core's own components take as ``pg_collection``).
    """

    pgs: ProcessGroupCollection

    tp_group = property(lambda self: self.pgs.tp)
    pp_group = property(lambda self: self.pgs.pp)
    dp_group = property(lambda self: self.pgs.dp)
    mp_group = property(lambda self: self.pgs.mp)
    ep_group = property(lambda self: self.pgs.ep)
    cp_group = property(lambda self: self.pgs.cp)
    tp_rank = property(lambda self: dist.get_rank(self.pgs.tp))
    tp_size = property(lambda self: dist.get_world_size(self.pgs.tp))
    pp_rank = property(lambda self: dist.get_rank(self.pgs.pp))
    pp_size = property(lambda self: dist.get_world_size(self.pgs.pp))
    dp_rank = property(lambda self: dist.get_rank(self.pgs.dp))
    dp_size = property(lambda self: dist.get_world_size(self.pgs.dp))
    mp_rank = property(lambda self: dist.get_rank(self.pgs.mp))
    mp_size = property(lambda self: dist.get_world_size(self.pgs.mp))
    ep_rank = property(lambda self: dist.get_rank(self.pgs.ep))
    ep_size = property(lambda self: dist.get_world_size(self.pgs.ep))
    cp_rank = property(lambda self: dist.get_rank(self.pgs.cp))
    cp_size = property(lambda self: dist.get_world_size(self.pgs.cp))
    mp_src_rank = property(lambda self: dist.get_global_rank(self.pgs.mp, 0))
    cp_src_rank = property(lambda self: dist.get_global_rank(self.pgs.cp, 0))
    pp_last_rank = property(lambda self: dist.get_global_rank(self.pgs.pp, self.pp_size - 1))
    is_first_stage = property(lambda self: self.pp_rank == 0)
    is_last_stage = property(lambda self: self.pp_rank == self.pp_size - 1)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _init_process_group() -> None:
    """Init from torchrun's env (RANK, WORLD_SIZE, MASTER_ADDR/PORT) or as a 1-process group."""
    global _OWNS_PROCESS_GROUP
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
    else:
        if cuda:
            torch.cuda.set_device(0)
        dist.init_process_group(
            backend=backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
        )
    _OWNS_PROCESS_GROUP = True


def initialize_parallel(*, tp_size: int, pp_size: int, seed: int, ep_size: int = 1, cp_size: int = 1) -> None:
    """Set up torch.distributed, Megatron's model-parallel groups and its RNG tracker.

    Initialises the default process group if needed (gloo on CPU, nccl on GPU; from torchrun's env
    or as a 1-process group on a free local port), applies the CPU shims when no GPU is present,
    calls ``parallel_state.initialize_model_parallel(tp_size, pp_size, ep_size, cp_size)`` (CP:
    ``parallel.context_parallel_size``), seeds the default
    generator with ``seed`` (identical on every rank, so CPU initialisation of the full weights
    agrees across TP ranks) and calls ``model_parallel_cuda_manual_seed(seed)`` (Megatron's
    per-TP-rank streams; the CPU tracker on CPU).

    The layout is the caller's to check against the world size (the trainer's config does, at load
    time); Megatron itself refuses a world size that ``tp_size * pp_size`` does not divide, or
    whose data-parallel size ``ep_size`` (expert parallelism, ``parallel.expert_model_parallel_size``)
    does not divide.

    Raises:
        ValueError: if Megatron's parallel state is already initialised (call ``destroy_parallel``).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        _init_process_group()
    if parallel_state.model_parallel_is_initialized():
        raise ValueError(
            "Megatron parallel state is already initialised: call destroy_parallel() first"
        )
    apply_cpu_shims()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size,
        expert_model_parallel_size=ep_size, context_parallel_size=cp_size,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    """Undo ``initialize_parallel``: Megatron's groups, and the process group if it created it."""
    global _OWNS_PROCESS_GROUP
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if _OWNS_PROCESS_GROUP and dist.is_initialized():
        dist.destroy_process_group()
    _OWNS_PROCESS_GROUP = False


def get_parallel_groups() -> ParallelGroups:
    """This rank's groups, read from Megatron's ``parallel_state``.

    Raises:
        ValueError: if ``initialize_parallel`` has not been called.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    if not ps.model_parallel_is_initialized():
        raise ValueError("parallel state is not initialised: call initialize_parallel() first")
    return ParallelGroups(ProcessGroupCollection.use_mpu_process_groups(required_pgs=list(PROCESS_GROUPS)))
