"""The memory plan's activations on the two-process part of the grid (TP 2, TP 2 + SP, PP 2, EP 2
of every shipped tiny model; :func:`tests.unit._memory_cases.grid_cases`): each rank's plan within
15% over and 2% under the bytes its forward saves for the backward (``saved_tensors_hooks``),
padded and packed. One spawn of 2 gloo processes runs every case, one layout after the other; each
rank measures its own pipeline stage (a later stage gets a random input of the previous stage's
shape), and under EP 2 its experts' share of the routed tokens, which the plan is given. About 25 s
on 2 cores: in the slow tier (tests/conftest.py).
"""

import pytest

from tests.distributed._megatron_layouts import megatron_layout
from tests.unit._memory_cases import grid_cases, measure_grid_case
from tests.unit.megatron.test_memory_grid import check_within_bounds

CASES = [case for case in grid_cases() if case.world == 2]


def _measure_all(rank, world_size):
    results = []
    for case in CASES:
        with megatron_layout(case.tp, case.pp, case.ep, seed=3) as groups:
            results.append((groups.pp_rank, measure_grid_case(case, stage=groups.pp_rank)))
    return results


@pytest.fixture(scope="module")
def measured(run_distributed):
    return run_distributed(_measure_all, 2, timeout_s=300)


@pytest.mark.parametrize("index", range(len(CASES)), ids=lambda i: "{0.model}-tp{0.tp}{1}-pp{0.pp}-ep{0.ep}-{0.precision}-"
                         "{0.recompute}".format(CASES[i], "sp" if CASES[i].sp else ""))
def test_plan_within_bounds_of_the_saved_bytes(measured, index):
    for rank_results in measured:
        stage, result = rank_results[index]
        check_within_bounds(CASES[index], stage, result)
