"""The loss side of context parallelism: what a loss needs to see only a part of each sequence.

Under context parallelism (CP) every sequence of a micro-batch is cut along its positions and each
CP rank holds some of its columns (Megatron's load-balanced split, :mod:`nemo_sspo.parallel.context_parallel`).
A policy loss is mostly per token, but several of its quantities are sums over a whole response
or segment (the segment ratio of SSPO, the sequence ratio of GSPO, per-response token counts,
Clip-Cov's batch means and top-k choice). :class:`CPContext` carries the reductions those need,
as callables, so this layer imports no process group: the host builds it
(:func:`nemo_sspo.parallel.context_parallel.make_cp_context`) and passes it as
``LossInputs.context_parallel``.

The design is ours. Every shared path that sums over the sequence takes the context and reduces
the partial sums of all CP ranks:

- :func:`nemo_sspo.algorithms.ratios.segment_mean`: per-(row, segment) sums and counts (one
  all-reduce of both; the sum is differentiable: the backward all-reduces the gradient, so each
  rank's tokens get the CP = 1 gradient of the sum of every rank's loss);
- :func:`nemo_sspo.algorithms.aggregation.aggregate` and the metrics: per-row token counts;
- the covariance selections of Clip-Cov / KL-Cov: the micro-batch means, the token quota and the
  top-k choice (:func:`select_top`).

What is counted once per response (the denominator of the response-level aggregation modes, the
response count of the metrics) is counted by CP rank 0 only (:attr:`CPContext.counts_items`), so
that the sum over CP ranks is the CP = 1 value. Per-token sums split naturally: each rank adds its
own tokens. The metric pairs a loss returns are reduced over CP inside
:func:`nemo_sspo.algorithms.losses.policy_loss_sums`: every CP rank holds the CP = 1 pairs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["CPContext", "cp_sum", "items_on_this_rank", "select_top"]

REDUCE_OPS = ("sum", "min", "max")


@dataclass(frozen=True)
class CPContext:
    """This rank's share of every sequence of a micro-batch and the reductions over its CP group.

    Attributes:
        positions: ``[S_local]`` int64, the global target position (column of the unsplit
            ``[B, S]`` micro-batch) of each local column, increasing.
        width: S, the unsplit width (segment ids of valid tokens lie in ``[0, S)``).
        rank: this rank's index in the CP group; size: the CP group size (>= 1).
        all_reduce: ``all_reduce(tensor, op) -> tensor`` over the CP group, ``op`` one of
            ``"sum"``, ``"min"``, ``"max"``; must not modify its input. For ``"sum"`` it must be
            differentiable with the backward an all-reduce SUM of the gradient
            (``torch.distributed.nn.functional.all_reduce``); ``"min"`` / ``"max"`` are read
            without gradient.
        all_gather: ``all_gather(tensor) -> [size, *tensor.shape]`` over the CP group, in rank
            order, without gradient.

    Every rank of a CP group must make the same calls in the same order (they are collectives):
    the loss code never branches on local data before a reduction.
    """

    positions: torch.Tensor
    width: int
    rank: int
    size: int
    all_reduce: Callable[[torch.Tensor, str], torch.Tensor]
    all_gather: Callable[[torch.Tensor], torch.Tensor]

    def __post_init__(self) -> None:
        if self.positions.dim() != 1 or self.positions.dtype != torch.int64:
            raise ValueError(f"CPContext.positions must be a [S_local] int64 tensor, got "
                             f"{tuple(self.positions.shape)} {self.positions.dtype}")
        if not 0 <= self.rank < self.size or self.width < self.positions.numel():
            raise ValueError(f"CPContext rank={self.rank}, size={self.size}, width={self.width} with "
                             f"{self.positions.numel()} local positions: need 0 <= rank < size and "
                             "width >= local positions")

    @property
    def counts_items(self) -> bool:
        """Whether this rank counts per-response items (rank 0 does, the others add 0)."""
        return self.rank == 0

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the CP group (differentiable)."""
        return self.all_reduce(tensor, "sum")

    def min(self, tensor: torch.Tensor) -> torch.Tensor:
        """Elementwise minimum over the CP group (no gradient)."""
        return self.all_reduce(tensor.detach(), "min")

    def max(self, tensor: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum over the CP group (no gradient)."""
        return self.all_reduce(tensor.detach(), "max")


def cp_sum(tensor: torch.Tensor, cp: CPContext | None) -> torch.Tensor:
    """``tensor`` summed over the CP group, or ``tensor`` itself without one."""
    return tensor if cp is None else cp.sum(tensor)


def items_on_this_rank(count: torch.Tensor, cp: CPContext | None) -> torch.Tensor:
    """A count of per-response items as this rank's share: all of it without CP or on CP rank 0,
    0 on the other CP ranks (so the sum over the group is the CP = 1 count).
    """
    return count if cp is None or cp.counts_items else torch.zeros_like(count)


def select_top(key: torch.Tensor, eligible: torch.Tensor, quota: torch.Tensor, *,
               max_quota: int, cp: CPContext) -> torch.Tensor:
    """``[B, S_local]`` bool: this rank's part of the ``quota`` eligible positions with the highest
    ``key`` over the whole (unsplit) micro-batch, ties to the earlier position in row-major order of
    the unsplit ``[B, S]`` (the CP = 1 rule of the covariance selections).

    Each rank sends only its ``max_quota`` best candidates (key, global row-major index), so the
    traffic is the quota, not the sequence: a position outside a rank's own top ``max_quota``
    cannot be among the global top ``quota <= max_quota``.

    Args:
        key: ``[B, S_local]`` float, the ranking key (finite at eligible positions).
        eligible: ``[B, S_local]`` bool.
        quota: 0-d tensor, the same on every CP rank (computed from CP-reduced counts).
        max_quota: an upper bound of ``quota`` known from shapes (same on every rank), >= 0.
        cp: the CP context.
    """
    rows, width = key.shape
    global_index = (torch.arange(rows, device=key.device)[:, None] * cp.width
                    + cp.positions.to(key.device)[None, :]).reshape(-1)
    flat = torch.where(eligible, key.detach().to(torch.float64),
                       torch.full((), -torch.inf, dtype=torch.float64, device=key.device)).reshape(-1)
    take = min(max_quota, flat.numel())
    # Local columns are in increasing global order, so a stable sort keeps ties in global order.
    order = torch.sort(flat, descending=True, stable=True).indices[:take]
    candidates = torch.stack([flat[order], global_index[order].to(torch.float64),
                              eligible.reshape(-1)[order].to(torch.float64)])  # [3, take]
    everyone = cp.all_gather(candidates).permute(1, 0, 2).reshape(3, -1)  # [3, size * take]
    keys, index, ok = everyone
    by_index = torch.sort(index, stable=True).indices
    by_key = by_index[torch.sort(keys[by_index], descending=True, stable=True).indices]
    rank = torch.empty_like(by_key)
    rank[by_key] = torch.arange(by_key.numel(), device=by_key.device)
    chosen = index[(rank < quota) & (ok > 0)].to(torch.int64)
    return torch.isin(global_index, chosen).reshape(rows, width) & eligible
