"""nemo_sspo.metrics: pair kinds set by the constructor (not the key), merging over micro-batches,
summaries, and the single-process reduction. Expected values are worked by hand in comments."""

import pytest
import torch

from nemo_sspo.metrics import (
    MetricPair,
    max_pair,
    mean_pair,
    mean_sq_pair,
    merge_metric_sums,
    min_pair,
    summarize_metric_pairs,
)
from nemo_sspo.parallel.metric_reduce import reduce_metric_sums


def _extreme(value, count, kind):
    return MetricPair(torch.tensor(float(value)), torch.tensor(float(count)), kind)


def test_extreme_constructors_skip_masked_values():
    values = torch.tensor([[3.0, -1.0, 9.0], [0.5, 7.0, -4.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    # Valid values {3, -1, 0.5}: min -1, max 3, 3 of them; 9, 7, -4 are masked.
    assert min_pair(values, mask).as_tensor().tolist() == [-1.0, 3.0]
    assert max_pair(values, mask).as_tensor().tolist() == [3.0, 3.0]
    assert max_pair(values, mask, torch.tensor(2.0)).as_tensor().tolist() == [3.0, 2.0]  # 2 rows
    empty = min_pair(values, torch.zeros_like(mask))
    assert (empty.kind, empty.as_tensor().tolist()) == ("min", [0.0, 0.0])  # value 0 when none valid


def test_merge_metric_sums_kinds():
    a = {"x": mean_pair(3, 2), "r_min": _extreme(0.5, 2, "min"), "r_max": _extreme(2, 2, "max"),
         "e_min": _extreme(0, 0, "min")}
    b = {"x": mean_pair(1, 1), "r_min": _extreme(0.25, 1, "min"), "r_max": _extreme(1, 1, "max"),
         "e_min": _extreme(7, 1, "min"), "y": mean_pair(1, 1)}
    merged = merge_metric_sums(a, b)
    assert merged["x"].as_tensor().tolist() == [4, 3]
    assert merged["r_min"].as_tensor().tolist() == [0.25, 3] and merged["r_max"].as_tensor().tolist() == [2, 3]
    assert merged["e_min"].as_tensor().tolist() == [7, 1]  # the empty side takes no part
    assert merged["y"].as_tensor().tolist() == [1, 1] and a["x"].as_tensor().tolist() == [3, 2]  # inputs untouched


def test_kind_comes_from_the_pair_not_the_key():
    # "lowest" holds a "min" pair, "x_min" a "mean" pair: merged as MIN (1, not 1 + 4) and as a
    # sum (x_min: (2 + 6) / (1 + 3) = 2), whatever the names say.
    a = {"lowest": _extreme(1, 1, "min"), "x_min": mean_pair(2, 1)}
    b = {"lowest": _extreme(4, 2, "min"), "x_min": mean_pair(6, 3)}
    assert summarize_metric_pairs(merge_metric_sums(a, b)) == {"lowest": 1.0, "x_min": 2.0}


def test_merging_different_kinds_raises():
    with pytest.raises(ValueError, match="cannot merge a 'mean' metric pair with a 'max' one"):
        merge_metric_sums({"k": mean_pair(1, 1)}, {"k": _extreme(1, 1, "max")})
    with pytest.raises(ValueError, match="unknown metric kind 'sum'"):
        MetricPair(torch.tensor(1.0), torch.tensor(1.0), "sum")


def test_summary_errors():
    with pytest.raises(TypeError, match="'k' must be a MetricPair, got Tensor"):
        summarize_metric_pairs({"k": torch.tensor([1.0, 2.0])})
    with pytest.raises(ValueError, match="'r2' must be named '<base>_sq'"):
        summarize_metric_pairs({"r2": mean_sq_pair(4, 2)})


def test_single_process_reduction_min_max_std():
    # four values with sum 6 and sum of squares 10: sum of (x - 1)^2 = 10 - 2 * 6 + 4 = 2
    local = {"r": mean_pair(6, 4), "r_sq": mean_sq_pair(2, 4), "r_min": _extreme(0.5, 4, "min"),
             "r_max": _extreme(2.5, 4, "max"), "e_max": _extreme(0, 0, "max"), "n": mean_pair(0, 0)}
    out = reduce_metric_sums(local, dp_group=None, pp_group=None, last_stage_rank=0,
                             is_last_stage=True)
    # mean 1.5, mean of squares 2.5 -> std sqrt(2.5 - 2.25) = 0.5.
    assert out["r"] == 1.5 and out["r_sq"] == 2.5 and out["r_std"] == pytest.approx(0.5)
    assert (out["r_min"], out["r_max"], out["e_max"], out["n"]) == (0.5, 2.5, 0.0, 0.0)
