"""reduce_metric_sums on real gloo groups: (sum, count) means, _min/_max extremes (an empty rank
takes no part), derived _std, and the broadcast from the last pipeline stage.

One spawn of 4 ranks laid out as 2 pipeline stages x 2 data-parallel replicas: ranks 0 and 1 are
the first stage (no metrics), ranks 2 and 3 the last stage (data-parallel group {2, 3}); the
pipeline groups are {0, 2} and {1, 3}. Expected values are worked by hand below.
"""

import pytest
import torch
import torch.distributed as dist

from nemo_sspo.metrics import MetricPair, mean_pair, mean_sq_pair


def _lo(value, count):
    return MetricPair(torch.tensor(float(value)), torch.tensor(float(count)), "min")


def _hi(value, count):
    return MetricPair(torch.tensor(float(value)), torch.tensor(float(count)), "max")


def _local(rank):
    if rank == 2:
        # ratio values {1, 2}: sum 3, squares 5, squared deviations from 1: 0 + 1 = 1; min 1, max 2.
        # e_min: this rank has none.
        return {"r": mean_pair(3, 2), "r_sq": mean_sq_pair(1, 2), "r_min": _lo(1, 2), "r_max": _hi(2, 2),
                "e_min": _lo(0, 0), "e_max": _hi(0, 0), "z_min": _lo(0, 0)}
    # rank 3, ratio values {0.5, 4.5}: sum 5, squares 20.5, squared deviations from 1: 0.25 + 12.25 = 12.5;
    # e values {-3}.
    return {"r": mean_pair(5, 2), "r_sq": mean_sq_pair(12.5, 2), "r_min": _lo(0.5, 2), "r_max": _hi(4.5, 2),
            "e_min": _lo(-3, 1), "e_max": _hi(-3, 1), "z_min": _lo(0, 0)}


def _reduce(rank, world_size):
    from nemo_sspo.parallel.metric_reduce import reduce_metric_sums

    dp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    last_stage = rank >= 2
    return reduce_metric_sums(
        _local(rank) if last_stage else {},
        dp_group=dp_groups[rank // 2],
        pp_group=pp_groups[rank % 2],
        last_stage_rank=2 + rank % 2,
        is_last_stage=last_stage,
    )


def test_min_max_mean_std_over_dp_and_pp(run_distributed):
    results = run_distributed(_reduce, 4)
    # Values {1, 2, 0.5, 4.5}: mean 8 / 4 = 2; mean of squares 25.5 / 4 = 6.375;
    # std sqrt(6.375 - 4) = sqrt(2.375); min 0.5; max 4.5. e: only rank 3 has one value, -3
    # (a MIN/MAX that let rank 2's empty 0 take part would give -3 / 0). z: empty everywhere -> 0.
    expected = {"r": 2.0, "r_sq": 6.375, "r_std": 2.375 ** 0.5, "r_min": 0.5, "r_max": 4.5,
                "e_min": -3.0, "e_max": -3.0, "z_min": 0.0}
    for rank, result in enumerate(results):
        assert result.keys() == expected.keys(), rank
        for key, value in expected.items():
            assert result[key] == pytest.approx(value, abs=1e-6), (rank, key)


def _reduce_different_keys(rank, world_size):
    from nemo_sspo.parallel.metric_reduce import reduce_metric_sums

    if rank == 0:  # a batch with no valid response token: no gap metric at all
        local = {"loss": mean_pair(-1.0, 4), "ratio_max": _hi(1.5, 4)}
    else:
        local = {"gap_abs": mean_pair(0.3, 3), "loss": mean_pair(2.0, 2), "ratio_max": _hi(1.2, 2),
                 "zgap_max": _hi(7, 1)}
    return reduce_metric_sums(local, dp_group=dist.group.WORLD, pp_group=None,
                              last_stage_rank=rank, is_last_stage=True)


def test_ranks_with_different_key_sets_reduce_by_name(run_distributed):
    # By name over both ranks: loss (-1 + 2) / (4 + 2) = 1/6; ratio_max max(1.5, 1.2) = 1.5;
    # gap_abs only on rank 1: 0.3 / 3 = 0.1; zgap_max only on rank 1: 7. Pairing by position
    # (rank 0's "loss" with rank 1's "gap_abs") would give loss (-1 + 0.3) / 7 = -0.1.
    expected = {"loss": 1 / 6, "ratio_max": 1.5, "gap_abs": 0.1, "zgap_max": 7.0}
    for rank, result in enumerate(run_distributed(_reduce_different_keys, 2)):
        assert result.keys() == expected.keys(), rank
        for key, value in expected.items():
            assert result[key] == pytest.approx(value, abs=1e-6), (rank, key)
