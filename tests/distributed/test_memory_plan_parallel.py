"""The memory plan under the distributed optimizer over DP 2, against built objects (one gloo run of
2 processes): each rank's parameter and grad buffers equal the plan's padded sizes exactly, and the
Adam states (fp32 main weights and both moments) of the two ranks add up to the plan's exactly (the
plan gives their mean per rank; a rank's shard is its half of the padded buffer).

The activations under TP 2, sequence parallelism, PP 2 and EP 2 are checked on the grid of
tests/distributed/test_memory_grid_parallel.py.
"""

from nemo_sspo.megatron import destroy_parallel, initialize_parallel
from nemo_sspo.megatron.memory import model_state_bytes, rank_parameters
from tests.unit._memory_cases import build_trained, counted_state_bytes, llama


def _dp2_state(rank, world_size):
    initialize_parallel(tp_size=1, pp_size=1, seed=3)  # DP 2
    ddp, optimizer = build_trained(llama(num_hidden_layers=2), precision="bf16", distributed=True)
    counted = counted_state_bytes(ddp, optimizer)
    destroy_parallel()
    return counted


def test_distributed_optimizer_bytes(run_distributed):
    config = llama(num_hidden_layers=2)
    results = run_distributed(_dp2_state, 2, timeout_s=240)
    planned = model_state_bytes(rank_parameters(config, tp=1, pp=1), param_bytes=2, dp=2, distributed_optimizer=True)
    # By hand: 119,104 parameters, every tensor a multiple of 64, padded to lcm(2, 128) = 128: 119,168.
    assert planned.weights == 2 * 119_168 and planned.gradients == 4 * 119_168
    for counted in results:
        assert (counted["weights"], counted["gradients"]) == (planned.weights, planned.gradients)
    # 12 bytes per parameter (fp32 main weight, exp_avg, exp_avg_sq), split between the two ranks
    assert sum(counted["optimizer"] for counted in results) == 12 * 119_104 == 2 * planned.optimizer
