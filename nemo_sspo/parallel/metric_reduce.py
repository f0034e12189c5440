"""Global reduction of step metrics so that every rank logs the same values.

A metric travels as a :class:`nemo_sspo.metrics.MetricPair` whose kind says how it combines.
Across data-parallel ranks additive pairs are summed and extremes reduced with MIN / MAX (an empty
pair takes no part); the result is then summarised exactly as in one process.

Metrics are produced on the last pipeline stage only and broadcast to the others. Data-parallel
ranks may hold different key sets (a rank whose batch has no valid token emits no token metrics):
the reduction runs over the union of keys, a key a rank lacks counting as an empty pair of the
kind the other ranks give it.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from nemo_sspo.metrics import MetricPair, summarize_metric_pairs

__all__ = ["collective_device", "reduce_metric_sums"]


def collective_device(group) -> torch.device:
    """Where tensors for a collective over ``group`` must live: the current CUDA device for NCCL,
    the CPU otherwise (gloo).

    ``group``: a process group from ``init_process_group`` / ``new_group`` (None: the default
    group), or a backend object built directly (``dist.ProcessGroupGloo(store, rank, size, ...)``,
    as :func:`nemo_sspo.parallel.world_split.split_world` builds the bridge and refit groups), which
    the world's group map does not know: its own ``name()`` says the backend.
    """
    backend = dist.get_backend(group) if group is None or isinstance(group, dist.ProcessGroup) else group.name()
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(kinds: list[str], stacked: torch.Tensor, dp_group) -> torch.Tensor:
    """SUM of counts and additive totals, MIN/MAX of extreme values; ``stacked`` [K, 2] float64
    (total, count) of pairs of ``kinds``.
    """
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


def _union_of_keys(kinds: dict[str, str], stacked: torch.Tensor, dp_group
                   ) -> tuple[dict[str, str], torch.Tensor]:
    """Every rank's sorted key -> kind map and ``[K, 2]`` pairs, with ``(0, 0)`` for keys it lacks.

    Without this, ranks with different key sets would pair values by position (wrong numbers) or
    all-reduce tensors of different lengths (a hang). One small object all-gather per step.

    Raises:
        ValueError: ranks give one key different kinds (raised on every rank alike).
    """
    gathered: list[dict[str, str] | None] = [None] * dist.get_world_size(dp_group)
    dist.all_gather_object(gathered, kinds, group=dp_group)
    union: dict[str, str] = {}
    for rank_kinds in gathered:
        for key, kind in rank_kinds.items():
            if union.setdefault(key, kind) != kind:
                raise ValueError(f"metric {key!r} is a {union[key]!r} pair on one data-parallel rank "
                                 f"and a {kind!r} pair on another")
    union = dict(sorted(union.items()))
    if list(union) == list(kinds):
        return kinds, stacked
    rows = {key: row for key, row in zip(kinds, stacked, strict=True)}
    zero = torch.zeros(2, dtype=stacked.dtype)
    return union, torch.stack([rows.get(key, zero) for key in union])


def reduce_metric_sums(
    local: dict[str, MetricPair],
    *,
    dp_group,
    pp_group,
    last_stage_rank: int,
    is_last_stage: bool,
) -> dict[str, float]:
    """All-reduces metric pairs over data parallelism and shares them across pipeline stages.

    Args:
        local: name -> pair of this rank's micro-batches (merged with
            ``nemo_sspo.metrics.merge_metric_sums``); read on the last stage only.
        dp_group: data-parallel group (None: single process, no communication).
        pp_group: pipeline group (None: single stage).
        last_stage_rank: global rank of this pipeline's last stage (broadcast source).
        is_last_stage: whether this rank holds the metrics.

    Returns:
        name -> float: total / count for additive pairs, the global extreme for ``"min"`` /
        ``"max"`` pairs, plus the derived ``_std`` keys; a metric whose global count is 0 reports
        0.0 (``nemo_sspo.metrics.summarize_metric_pairs``).

    Raises:
        TypeError: a value is not a ``MetricPair``.
        ValueError: ranks give one key different kinds.
    """
    result: dict[str, float] | None = None
    if is_last_stage:
        for key, value in local.items():
            if not isinstance(value, MetricPair):
                raise TypeError(f"metric {key!r} must be a MetricPair, got {type(value).__name__}")
        kinds = {key: local[key].kind for key in sorted(local)}
        # On the host: pairs may come from the model's device (loss metrics) and the CPU (rollout metrics).
        stacked = (torch.stack([local[k].as_tensor(torch.float64).cpu() for k in kinds]) if kinds
                   else torch.zeros(0, 2, dtype=torch.float64))
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            kinds, stacked = _union_of_keys(kinds, stacked, dp_group)
            stacked = _all_reduce(list(kinds.values()), stacked, dp_group)
        result = summarize_metric_pairs({key: MetricPair(row[0], row[1], kind)
                                         for (key, kind), row in zip(kinds.items(), stacked, strict=True)})
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        box = [result]
        dist.broadcast_object_list(box, src=last_stage_rank, group=pp_group)
        result = box[0]
    return result
