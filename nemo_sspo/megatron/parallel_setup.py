"""Process-group and Megatron parallel-state setup; the one reader of ``parallel_state``.

Rank layout is Megatron's default order (tp-cp-ep-dp-pp): tensor-parallel ranks are adjacent, e.g.
world 4 with TP=2, PP=2 gives TP groups {0,1}, {2,3} and PP groups {0,2}, {1,3}.
"""

from __future__ import annotations

import dataclasses
import os
import socket

import torch
import torch.distributed as dist

from nemo_sspo.megatron.cpu_shims import apply_cpu_shims

__all__ = ["ParallelGroups", "destroy_parallel", "get_parallel_groups", "initialize_parallel"]

# True while the default process group is one that initialize_parallel created (so that
# destroy_parallel tears it down, but never a group a launcher or test fixture owns).
_OWNS_PROCESS_GROUP = False


@dataclasses.dataclass(frozen=True)
class ParallelGroups:
    """This rank's tensor-, pipeline-, data- and model-parallel groups with ranks and sizes.

    The model-parallel group holds the TP x PP ranks of one data-parallel replica; ``mp_src_rank``
    is its first member's global rank and ``pp_last_rank`` the global rank of this pipeline's last
    stage (the sources of rollout and metric broadcasts). The expert-model-parallel group
    (``ep_group``, size ``ep_size``; 1 for dense models) holds the ranks that split one MoE layer's
    experts: same TP rank and pipeline stage, different data-parallel replicas. The
    context-parallel group (``cp_group``, size ``cp_size``; ``parallel.context_parallel_size``)
    holds the ranks that split each sequence of one replica (same TP rank and stage);
    ``cp_src_rank`` is its first member's global rank. With CP > 1 the data-parallel group is
    Megatron's without CP (replicas), and a replica spans TP x CP x PP ranks.
    """

    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    mp_group: dist.ProcessGroup
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    mp_rank: int
    mp_size: int
    mp_src_rank: int
    pp_last_rank: int
    is_first_stage: bool
    is_last_stage: bool
    ep_group: dist.ProcessGroup
    ep_rank: int
    ep_size: int
    cp_group: dist.ProcessGroup | None = None
    cp_rank: int = 0
    cp_size: int = 1
    cp_src_rank: int | None = None


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

    if not ps.model_parallel_is_initialized():
        raise ValueError("parallel state is not initialised: call initialize_parallel() first")
    mp_group = ps.get_model_parallel_group()
    pp_group = ps.get_pipeline_model_parallel_group()
    return ParallelGroups(
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=pp_group,
        dp_group=ps.get_data_parallel_group(),
        mp_group=mp_group,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        mp_rank=dist.get_rank(mp_group),
        mp_size=dist.get_world_size(mp_group),
        mp_src_rank=dist.get_global_rank(mp_group, 0),
        pp_last_rank=dist.get_global_rank(pp_group, dist.get_world_size(pp_group) - 1),
        is_first_stage=ps.is_pipeline_first_stage(),
        is_last_stage=ps.is_pipeline_last_stage(),
        ep_group=ps.get_expert_model_parallel_group(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        cp_group=ps.get_context_parallel_group(),
        cp_rank=ps.get_context_parallel_rank(),
        cp_size=ps.get_context_parallel_world_size(),
        cp_src_rank=dist.get_global_rank(ps.get_context_parallel_group(), 0),
    )
