"""Context parallelism on the loss side: Megatron's load-balanced split of a sequence and the
CP group's reductions for :class:`nemo_sspo.algorithms.cp_context.CPContext`.

The split (megatron-core's ``get_batch_on_this_cp_rank``, megatron/core/utils.py): a sequence of
``S`` positions, ``S`` divisible by ``2 * CP``, is cut into ``2 * CP`` equal chunks; CP rank ``r``
holds chunks ``r`` and ``2 * CP - 1 - r``, in that order. Under causal attention the early chunks
are cheap and the late ones expensive, so pairing chunk ``r`` with its mirror balances the work.
With ``S = 8``, ``CP = 2`` (chunks of 2): rank 0 holds positions 0, 1, 6, 7 and rank 1 holds
2, 3, 4, 5.

The reductions (ours): :func:`make_cp_context` wraps the CP process group into the callables the
loss reads: a differentiable all-reduce SUM (its backward all-reduces the gradient, as
``torch.distributed.nn.functional.all_reduce`` does), MIN / MAX without gradient, and an all-gather.
:func:`gather_sequence` undoes the split for forward-only outputs (old-policy log-probs).
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch
import torch.distributed as dist

from nemo_sspo.algorithms.cp_context import CPContext
from nemo_sspo.algorithms.micro_batches import MicroBatch

__all__ = ["cp_padded_width", "gather_sequence", "make_cp_context", "split_micro_batch", "split_sequence",
           "zigzag_positions"]

# Padding of the [b, S] fields up to a multiple of 2 x CP: masked target positions (never read).
_PAD_VALUES = {"loss_mask": False, "segment_ids": -1}

_OPS = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


class _AllReduceSum(torch.autograd.Function):
    """All-reduce SUM whose backward is the all-reduce SUM of the gradient (as
    ``torch.distributed.nn.functional.all_reduce``, deprecated in torch 2.13): the loss of every
    rank depends on the sum, so each rank's input gets the sum of every rank's gradient.
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = tensor.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.detach().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def cp_padded_width(width: int, cp_size: int) -> int:
    """The smallest multiple of ``2 * cp_size`` that is >= ``width`` (the split needs one)."""
    chunk = 2 * cp_size
    return -(-width // chunk) * chunk


def zigzag_positions(width: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """``[width / cp_size]`` int64: the positions CP rank ``cp_rank`` holds, in its local order
    (chunk ``cp_rank``, then chunk ``2 * cp_size - 1 - cp_rank``; Megatron's split, module
    docstring).

    Raises:
        ValueError: ``cp_size < 1``, ``cp_rank`` outside ``[0, cp_size)``, or ``width`` not
            divisible by ``2 * cp_size`` (pad it to :func:`cp_padded_width`).
    """
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_size={cp_size}, cp_rank={cp_rank}: need cp_size >= 1 and 0 <= cp_rank < cp_size")
    if cp_size == 1:
        return torch.arange(width, dtype=torch.int64)
    chunks = 2 * cp_size
    if width % chunks:
        raise ValueError(f"a sequence of {width} positions does not split into 2 x context_parallel_size = "
                         f"{chunks} equal chunks; pad it to {cp_padded_width(width, cp_size)}")
    size = width // chunks
    return torch.cat([torch.arange(c * size, (c + 1) * size, dtype=torch.int64)
                      for c in (cp_rank, chunks - 1 - cp_rank)])


def split_sequence(tensor: torch.Tensor, cp_size: int, cp_rank: int, *, dim: int = 1) -> torch.Tensor:
    """This CP rank's columns of ``tensor`` along ``dim`` (``[b, S, ...]`` -> ``[b, S / CP, ...]``),
    as :func:`zigzag_positions`.

    Raises:
        ValueError: as :func:`zigzag_positions`.
    """
    index = zigzag_positions(tensor.shape[dim], cp_size, cp_rank).to(tensor.device)
    return tensor.index_select(dim, index)


def gather_sequence(local: torch.Tensor, group, *, dim: int = 1) -> torch.Tensor:
    """The unsplit tensor from every CP rank's ``local`` part (inverse of :func:`split_sequence`),
    on every rank, without gradient: for forward-only outputs, never for the loss.

    Args:
        local: ``[b, S / CP, ...]`` this rank's columns along ``dim``.
        group: the CP process group.
        dim: the sequence dimension.
    """
    size = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    width = local.shape[dim] * size
    index = torch.cat([zigzag_positions(width, size, r) for r in range(size)]).to(local.device)
    out = torch.empty_like(torch.cat(parts, dim=dim))
    return out.index_copy_(dim, index, torch.cat(parts, dim=dim))


def make_cp_context(group, positions: torch.Tensor, width: int) -> CPContext:
    """The :class:`CPContext` of this rank in the CP process group ``group``.

    Args:
        group: the context-parallel process group (Megatron's ``get_context_parallel_group()``).
        positions: ``[S_local]`` int64 global positions of this rank's columns
            (:func:`zigzag_positions`).
        width: the unsplit width ``S``.
    """

    def all_reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
        if op == "sum":
            if tensor.requires_grad:
                return _AllReduceSum.apply(tensor, group)
            op_value = dist.ReduceOp.SUM
        elif op in _OPS:
            op_value = _OPS[op]
        else:
            raise ValueError(f"unknown reduction {op!r}; valid: sum, min, max")
        out = tensor.detach().clone()
        dist.all_reduce(out, op=op_value, group=group)
        return out

    def all_gather(tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.detach().contiguous(), group=group)
        return torch.stack(parts)

    return CPContext(positions=positions, width=width, rank=dist.get_rank(group),
                     size=dist.get_world_size(group), all_reduce=all_reduce, all_gather=all_gather)


def split_micro_batch(micro: MicroBatch, cp_size: int, cp_rank: int) -> tuple[MicroBatch, torch.Tensor, int]:
    """This CP rank's part of a (row-per-response) micro-batch: every ``[b, S_b, ...]`` field of
    ``micro.batch`` and the model input, right-padded to ``S = cp_padded_width(S_b)`` (padding is
    masked, and under causal attention trailing positions change nothing before them) and split
    with :func:`split_sequence`.

    Returns:
        ``(local micro-batch [b, S / CP], positions [S / CP] int64, S)``: the positions and the
        padded width build the rank's ``CPContext`` (:func:`make_cp_context`).

    Raises:
        ValueError: a packed micro-batch (``sequence_lengths`` / ``token_index`` set: packed rows
            need a split per sequence, refused at config load), or routes (router replay).
    """
    if micro.sequence_lengths is not None or micro.token_index is not None:
        raise ValueError("context parallelism splits one sequence per row; packed micro-batches (sequence_lengths "
                         "or token_index set) are not supported with a context-parallel size above 1")
    batch = micro.batch
    if batch.routes is not None:
        raise ValueError("context parallelism does not split MoE routes: pass a micro-batch without routes "
                         "(no router replay)")
    width = batch.loss_mask.shape[1]
    if micro.input_ids.shape[1] != width:
        raise ValueError(f"micro-batch input width {micro.input_ids.shape[1]} differs from its target frame's "
                         f"{width}: context parallelism needs one sequence per row")
    padded = cp_padded_width(width, cp_size)

    def local(name: str, value: torch.Tensor) -> torch.Tensor:
        rows = value.shape[0]
        if name == "position_ids":
            pad = torch.arange(width, padded, dtype=value.dtype, device=value.device).expand(rows, -1)
        else:
            pad = torch.full((rows, padded - width, *value.shape[2:]), _PAD_VALUES.get(name, 0),
                             dtype=value.dtype, device=value.device)
        return split_sequence(torch.cat([value, pad], dim=1), cp_size, cp_rank)

    split = {f.name: local(f.name, value) for f in fields(batch)
             if isinstance(value := getattr(batch, f.name), torch.Tensor) and value.dim() >= 2}
    # The model input separately: a pass-count filler has no rows in ``batch`` but runs its input.
    local_micro = replace(micro, batch=replace(batch, **split), input_ids=local("input_ids", micro.input_ids),
                          position_ids=local("position_ids", micro.position_ids))
    return local_micro, zigzag_positions(padded, cp_size, cp_rank), padded
