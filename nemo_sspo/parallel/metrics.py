"""Global reduction of step metrics so that every rank logs the same values.

A metric travels as a float32 [2] tensor ``(sum, count)``; the global value is
``sum over micro-batches and data-parallel ranks / count over the same``, never a mean of means
(pitfall P10). Metrics are produced on the last pipeline stage only and broadcast to the others.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["reduce_metric_sums"]


def reduce_metric_sums(
    local: dict[str, torch.Tensor],
    *,
    dp_group,
    pp_group,
    last_stage_rank: int,
    is_last_stage: bool,
) -> dict[str, float]:
    """All-reduces ``(sum, count)`` pairs over data parallelism and shares them across pipeline stages.

    Args:
        local: name -> float32 [2] (sum, count) of this rank's micro-batches; read on the last stage only.
        dp_group: data-parallel group (None: single process, no communication).
        pp_group: pipeline group (None: single stage).
        last_stage_rank: global rank of this pipeline's last stage (broadcast source).
        is_last_stage: whether this rank holds the metrics.

    Returns:
        name -> sum / count as float; a metric whose global count is 0 reports 0.0 (nothing to average).

    Raises:
        ValueError: a value is not a [2] tensor.
    """
    result: dict[str, float] | None = None
    if is_last_stage:
        keys = sorted(local)
        for key in keys:
            if local[key].shape != (2,):
                raise ValueError(f"metric {key!r} must be a (sum, count) tensor of shape [2], got {tuple(local[key].shape)}")
        stacked = torch.stack([local[k].to(torch.float64) for k in keys]) if keys else torch.zeros(0, 2, dtype=torch.float64)
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            dist.all_reduce(stacked, group=dp_group)
        result = {k: (float(s / c) if c > 0 else 0.0) for k, (s, c) in zip(keys, stacked.tolist())}
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        box = [result]
        dist.broadcast_object_list(box, src=last_stage_rank, group=pp_group)
        result = box[0]
    return result
