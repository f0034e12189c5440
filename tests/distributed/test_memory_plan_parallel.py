"""The memory plan under TP 2 and under the distributed optimizer over DP 2, against built objects
(one gloo run of 2 processes: first TP 2, then DP 2).

TP 2: the activations each rank's forward saves (``saved_tensors_hooks``) are within 15% of the
plan's, padded and packed, without and with selective recomputation. DP 2 with megatron's
distributed optimizer: each rank's parameter and grad buffers equal the plan's padded sizes exactly,
and the Adam states (fp32 main weights and both moments) of the two ranks add up to the plan's
exactly (the plan gives their mean per rank; a rank's shard is its half of the padded buffer).
"""

import torch

from nemo_sspo.megatron import build_policy_model, destroy_parallel, initialize_parallel
from nemo_sspo.megatron.memory import activation_bytes, model_state_bytes, rank_parameters
from tests.unit._memory_cases import (
    build_trained,
    counted_state_bytes,
    llama,
    padded_and_packed_inputs,
    recompute,
    saved_activation_bytes,
)


def _both_layouts(rank, world_size):
    config = llama(num_hidden_layers=2)
    measured = {}
    initialize_parallel(tp_size=2, pp_size=1, seed=3)
    (ids, pos), (packed, packed_pos, lengths) = padded_and_packed_inputs(config.vocab_size, 2, 40, [30, 26, 24])
    for granularity in (None, "selective"):
        with recompute(granularity):
            torch.manual_seed(0)
            model = build_policy_model(config).train()
            for name, inputs in (("padded", (ids, pos, None)), ("packed", (packed, packed_pos, lengths))):
                measured[(granularity, name)] = saved_activation_bytes(model, *inputs)
    destroy_parallel()
    initialize_parallel(tp_size=1, pp_size=1, seed=3)  # DP 2
    ddp, optimizer = build_trained(config, precision="bf16", distributed=True)
    counted = counted_state_bytes(ddp, optimizer)
    destroy_parallel()
    return measured, counted


def test_tp2_activations_and_distributed_optimizer_bytes(run_distributed):
    config = llama(num_hidden_layers=2)
    results = run_distributed(_both_layouts, 2, timeout_s=240)
    for measured, _ in results:
        for (granularity, name), value in measured.items():
            rows, seq = (2, 40) if name == "padded" else (1, 80)
            planned = activation_bytes(config, tokens=rows * seq, rows=rows, seq=seq, tp=2, pp=1, stage=0,
                                       act_bytes=4, impl="local", recompute=granularity or "none").saved
            assert abs(planned - value) <= 0.15 * value, (granularity, name, value, planned)
    planned = model_state_bytes(rank_parameters(config, tp=1, pp=1), param_bytes=2, dp=2, distributed_optimizer=True)
    # By hand: 119,104 parameters, every tensor a multiple of 64, padded to lcm(2, 128) = 128: 119,168.
    assert planned.weights == 2 * 119_168 and planned.gradients == 4 * 119_168
    for _, counted in results:
        assert (counted["weights"], counted["gradients"]) == (planned.weights, planned.gradients)
    # 12 bytes per parameter (fp32 main weight, exp_avg, exp_avg_sq), split between the two ranks
    assert sum(counted["optimizer"] for _, counted in results) == 12 * 119_104 == 2 * planned.optimizer
