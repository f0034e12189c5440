"""Global reduction of step metrics so that every rank logs the same values.

A metric travels as a float32 [2] pair whose kind its key's suffix gives (``(sum, count)``,
``_min`` / ``_max`` extremes, derived ``_std``; :mod:`nemo_sspo.algorithms.losses.metrics`).
Across data-parallel ranks plain pairs are summed and extremes reduced with MIN / MAX (an empty
pair takes no part); the result is then summarised exactly as in one process.

Metrics are produced on the last pipeline stage only and broadcast to the others. Data-parallel
ranks may hold different key sets (a rank whose batch has no valid token emits no token metrics):
the reduction runs over the union of keys, a key a rank lacks counting as an empty pair.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from nemo_sspo.algorithms.losses.metrics import merge_metric_sums, metric_kind, summarize_metric_pairs

__all__ = ["collective_device", "merge_metric_sums", "metric_kind", "reduce_metric_sums"]


def collective_device(group) -> torch.device:
    """Where tensors for a collective over ``group`` must live: the current CUDA device for NCCL,
    the CPU otherwise (gloo)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(keys: list[str], stacked: torch.Tensor, dp_group) -> torch.Tensor:
    """SUM of counts and plain sums, MIN/MAX of extreme values; ``stacked`` [K, 2] float64."""
    kinds = [metric_kind(k) for k in keys]
    is_min = torch.tensor([k == "min" for k in kinds], dtype=torch.bool, device=stacked.device)
    is_max = torch.tensor([k == "max" for k in kinds], dtype=torch.bool, device=stacked.device)
    extreme = is_min | is_max
    empty = stacked[:, 1] <= 0
    # Max as a min of negated values: one MIN collective for both kinds; empty pairs are neutral.
    signed = torch.where(is_max, -stacked[:, 0], stacked[:, 0])
    signed = torch.where(empty, torch.full_like(signed, math.inf), signed)[extreme]
    summed = stacked.clone()
    summed[extreme, 0] = 0.0
    device = collective_device(dp_group)
    summed, signed = summed.to(device), signed.to(device)
    dist.all_reduce(summed, group=dp_group)
    dist.all_reduce(signed, op=dist.ReduceOp.MIN, group=dp_group)
    summed, signed = summed.cpu(), signed.cpu()
    summed[extreme, 0] = torch.where(is_max[extreme], -signed, signed)
    return summed


def _union_of_keys(keys: list[str], stacked: torch.Tensor, dp_group) -> tuple[list[str], torch.Tensor]:
    """Every rank's sorted key list and ``[K, 2]`` pairs, with ``(0, 0)`` for keys it lacks.

    Without this, ranks with different key sets would pair values by position (wrong numbers) or
    all-reduce tensors of different lengths (a hang). One small object all-gather per step.
    """
    gathered: list[list[str] | None] = [None] * dist.get_world_size(dp_group)
    dist.all_gather_object(gathered, keys, group=dp_group)
    union = sorted(set().union(*gathered))
    if union == keys:
        return keys, stacked
    rows = {key: row for key, row in zip(keys, stacked)}
    zero = torch.zeros(2, dtype=stacked.dtype)
    return union, torch.stack([rows.get(key, zero) for key in union])


def reduce_metric_sums(
    local: dict[str, torch.Tensor],
    *,
    dp_group,
    pp_group,
    last_stage_rank: int,
    is_last_stage: bool,
) -> dict[str, float]:
    """All-reduces metric pairs over data parallelism and shares them across pipeline stages.

    Args:
        local: name -> float32 [2] pair of this rank's micro-batches (kinds in the module
            docstring); read on the last stage only.
        dp_group: data-parallel group (None: single process, no communication).
        pp_group: pipeline group (None: single stage).
        last_stage_rank: global rank of this pipeline's last stage (broadcast source).
        is_last_stage: whether this rank holds the metrics.

    Returns:
        name -> float: sum / count for plain pairs, the global extreme for ``_min`` / ``_max``,
        plus the derived ``_std`` keys; a metric whose global count is 0 reports 0.0.

    Raises:
        ValueError: a value is not a [2] tensor.
    """
    result: dict[str, float] | None = None
    if is_last_stage:
        keys = sorted(local)
        for key in keys:
            if local[key].shape != (2,):
                raise ValueError(f"metric {key!r} must be a (sum, count) tensor of shape [2], got {tuple(local[key].shape)}")
        # On the host: pairs may come from the model's device (loss metrics) and the CPU (rollout metrics).
        stacked = (torch.stack([local[k].detach().to("cpu", torch.float64) for k in keys]) if keys
                   else torch.zeros(0, 2, dtype=torch.float64))
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            keys, stacked = _union_of_keys(keys, stacked, dp_group)
            stacked = _all_reduce(keys, stacked, dp_group)
        result = summarize_metric_pairs(dict(zip(keys, stacked)))
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        box = [result]
        dist.broadcast_object_list(box, src=last_stage_rank, group=pp_group)
        result = box[0]
    return result
