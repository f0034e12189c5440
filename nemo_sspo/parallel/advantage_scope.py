"""An advantage estimator's scope statistics over the data-parallel ranks.

:func:`nemo_sspo.algorithms.advantage_estimators.estimate_advantages` builds a ``[S, 1 + K]`` float64
table per rank (per scope: the row count and the sums of the estimator's row values); for the
``optimizer_batch`` and ``step`` scopes the S scopes are the same on every data-parallel rank, so one
all-reduce SUM over the data-parallel group gives every rank the whole scope's counts and sums. A
``group`` scope never leaves its rank (a prompt group is one rank's). An estimator with per-group
values (``group_values``: a per-prompt history such as DCPO's) gets every rank's groups with their
prompt keys from one ``all_gather_object`` over the data-parallel group, in rank (= slot) order.
``placement: separate``
passes the training ranks' data-parallel group: rollout ranks take no part.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nemo_sspo.algorithms.advantage_estimators import (
    AdvantageEstimator,
    AdvantageInputs,
    estimate_advantages_and_history,
)
from nemo_sspo.algorithms.advantages import PromptRewardStats
from nemo_sspo.parallel.metric_reduce import collective_device

__all__ = ["data_parallel_advantages", "gather_over_data_parallel", "sum_over_data_parallel"]


def sum_over_data_parallel(table: torch.Tensor, *, dp_group) -> torch.Tensor:
    """``table`` summed over the ranks of ``dp_group`` (a new CPU float64 tensor; collective).

    Args:
        table: ``[S, 1 + K]`` float64, the same S scopes on every rank.
        dp_group: the data-parallel process group (required; None means the default group).
    """
    on_device = table.to(collective_device(dp_group), dtype=torch.float64, copy=True)
    dist.all_reduce(on_device, group=dp_group)
    return on_device.cpu()


def gather_over_data_parallel(obj, *, dp_group, dp_size: int) -> tuple[list, int]:
    """``(every rank's obj in data-parallel order, this rank's index)`` (collective over ``dp_group``)."""
    parts = [None] * dp_size
    dist.all_gather_object(parts, obj, group=dp_group)
    return parts, dist.get_rank(group=dp_group)


def data_parallel_advantages(estimator: AdvantageEstimator, inputs: AdvantageInputs, *, minibatches: int,
                             dp_group, dp_size: int) -> tuple[torch.Tensor, dict[str, PromptRewardStats] | None]:
    """``([B] float32 advantages of this rank's rows, per-prompt history after the step or None)``, the
    scope statistics summed (and the step's groups gathered) over ``dp_group`` (collective for
    ``optimizer_batch`` / ``step`` scopes when ``dp_size > 1``; every rank of the group must call it).

    Args:
        estimator: the registered estimator.
        inputs: this rank's rows (whole prompt groups in slot order).
        minibatches: optimizer steps per training step (``trainer.minibatches_per_step``).
        dp_group: the data-parallel group.
        dp_size: its size (1: no collective).

    Raises:
        ValueError: as ``estimate_advantages``.
    """
    reduce = gather = None
    if dp_size > 1:
        def reduce(table: torch.Tensor) -> torch.Tensor:
            return sum_over_data_parallel(table, dp_group=dp_group)

        def gather(obj) -> tuple[list, int]:
            return gather_over_data_parallel(obj, dp_group=dp_group, dp_size=dp_size)
    return estimate_advantages_and_history(estimator, inputs, minibatches=minibatches, reduce=reduce, gather=gather)
