"""Every data-parallel rank runs the same number of forward(/backward) passes per mini-batch.

The batch and model are ``test_invariance``'s (8 rows, prompt + response lengths
[8, 5, 11, 3, 3, 11, 2, 3], a tiny tied Llama). At DP = 2 rank 0 holds rows 0-3 ([8, 5, 11, 3])
and rank 1 rows 4-7 ([3, 11, 2, 3]); nothing rebalances them here. Worked by hand:

- token budget 11 padded tokens (rows x longest), longest first: rank 0 plans [11] [8] [5, 3]
  (2 x 8 = 16 > 11 keeps 8 and 5 apart; 2 x 5 = 10 fits), 3 micro-batches; rank 1 plans
  [11] [3, 3, 2] (3 x 3 = 9), 2 micro-batches;
- packed rows of 11 tokens, first-fit decreasing: rank 0 [11] [8, 3] [5], 3 rows; rank 1
  [11] [3, 3, 2], 2 rows.

Each forward all-reduces over the data-parallel group (a pre-hook on the model, as
TransformerEngine's FP8 amax reduction under the delayed recipe does in every forward). Before the
fix rank 1 left the schedule after 2 passes while rank 0 waited in its third forward: the spawn
failed or hung until the timeout. After it, both ranks run 3 passes (rank 1's third holds no
response), and loss, gradients, metric counts and old log-probs equal the single process.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from tests.distributed.test_invariance import TEMPERATURE, _fixture_data, _grads_as_hf

LAYOUTS = {"budget": dict(max_tokens=11, pack=False), "packed": dict(max_tokens=11, pack=True)}
LOSSES = ("sspo", "dapo")  # a response-count and a token-count denominator
PLANNED = {0: 3, 1: 2}  # micro-batches each DP rank plans, worked out above (both layouts)
TIMEOUT_S = 120  # a hang fails the test instead of blocking the suite (before the fix: TimeoutError)


def _dp_collective_hook(dp_group, calls: list):
    """Forward pre-hook: all-reduce MAX of the input's largest id over ``dp_group``, as FP8's amax."""
    import torch.distributed as dist

    def hook(module, args):
        amax = args[0].abs().max().double().reshape(1) if args[0].numel() else torch.zeros(1)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=dp_group)
        calls.append(float(amax))

    return hook


def _run(rank, world_size):
    from nemo_sspo.algorithms.losses import DAPOLossConfig, SSPOLossConfig, make_policy_loss
    from nemo_sspo.algorithms.micro_batches import MicroBatchLayout
    from nemo_sspo.megatron import (build_policy_model, destroy_parallel, get_parallel_groups,
                                    initialize_parallel, load_hf_into_megatron, vocab_shard)
    from nemo_sspo.megatron.model import unwrap_model
    from nemo_sspo.megatron.step import LossSpec
    from nemo_sspo.megatron.training import compute_gradients, compute_old_logprobs, wrap_for_training
    from nemo_sspo.parallel.metric_reduce import reduce_metric_sums

    configs = {"sspo": SSPOLossConfig(alpha=0.0, beta=0.8, gamma=1.1),
               "dapo": DAPOLossConfig(eps_low=0.2, eps_high=0.28, dual_clip_c=None, aggregation="token-mean")}
    hf_config, hf_state, batch, noise = _fixture_data()
    initialize_parallel(tp_size=1, pp_size=1, seed=0)
    groups = get_parallel_groups()
    model = build_policy_model(hf_config)
    load_hf_into_megatron(model, hf_state, hf_config)
    ddp, _ = wrap_for_training(model, lr=1e-3, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
                               adam_eps=1e-8, clip_grad=0.0)
    calls: list = []
    if world_size > 1:
        unwrap_model(ddp).register_forward_pre_hook(_dp_collective_hook(groups.dp_group, calls))
    rows = batch.input_ids.shape[0] // world_size
    local = batch.select(slice(rank * rows, (rank + 1) * rows))
    local_noise = noise[rank * rows : (rank + 1) * rows]
    vocab_start, vocab_size = vocab_shard(model)
    results = {}
    for layout_name, option in LAYOUTS.items():
        layout = MicroBatchLayout(**option)
        planned = len(layout.plan(local))
        for loss_name in LOSSES:
            spec = LossSpec(loss=make_policy_loss(loss_name, configs[loss_name]),
                            tp_group=None, vocab_start=vocab_start, vocab_size=vocab_size,
                            temperature=TEMPERATURE, max_response_length=8, output_chunk_size=3)
            before = len(calls)
            scored = compute_old_logprobs(ddp, local, spec, layout, dp_group=groups.dp_group)
            old_passes = len(calls) - before
            noisy = replace(scored, old_logprobs=scored.old_logprobs + local_noise)  # ratios != 1
            sums = compute_gradients(ddp, noisy, spec, layout, dp_group=groups.dp_group)
            train_passes = len(calls) - before - old_passes
            metrics = reduce_metric_sums(sums, dp_group=groups.dp_group, pp_group=groups.pp_group,
                                         last_stage_rank=groups.pp_last_rank,
                                         is_last_stage=groups.is_last_stage)
            counts = {key: float(pair.count) for key, pair in sums.items()}
            results[(layout_name, loss_name)] = dict(
                planned=planned, old_passes=old_passes, train_passes=train_passes,
                loss=metrics["loss/policy"], counts=counts, old_logprobs=scored.old_logprobs,
                grads=_grads_as_hf(ddp, hf_config))
    destroy_parallel()
    return results


@pytest.fixture(scope="module")
def runs(run_distributed):
    return {world: run_distributed(_run, world, timeout_s=TIMEOUT_S) for world in (1, 2)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ranks_run_equal_pass_counts_with_a_collective_in_every_forward(runs, layout):
    for rank, result in enumerate(runs[2]):
        for loss in LOSSES:
            got = result[(layout, loss)]
            assert got["planned"] == PLANNED[rank]  # the unequal plans worked out by hand
            # max(3, 2) = 3 passes on both ranks, forward-only and training alike
            assert got["old_passes"] == got["train_passes"] == 3


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_padded_passes_leave_loss_gradients_and_metrics_of_one_process(runs, layout, loss):
    one = runs[1][0][(layout, loss)]
    rank0, rank1 = (result[(layout, loss)] for result in runs[2])
    assert math.isclose(rank0["loss"], one["loss"], rel_tol=1e-6)
    assert rank0["loss"] == rank1["loss"]
    # Metric counts (denominators included): the two ranks' counts add up to one process's, so
    # the empty pass on rank 1 counted nothing.
    assert one["counts"].keys() == rank0["counts"].keys() == rank1["counts"].keys()
    for key, count in one["counts"].items():
        # (some counts are float32 sums of per-segment fractions: equal up to rounding)
        assert math.isclose(rank0["counts"][key] + rank1["counts"][key], count, rel_tol=1e-6), key
    for key, ref in one["grads"].items():
        for result in (rank0, rank1):
            err = float((result["grads"][key] - ref).norm() / ref.norm().clamp_min(1e-30))
            assert err < 1e-5, key
    # Forward-only pass: each rank's rows keep the single process's log-probs (the empty pass
    # wrote nothing back).
    both = torch.cat([rank0["old_logprobs"], rank1["old_logprobs"]])
    torch.testing.assert_close(both, one["old_logprobs"][:, : both.shape[1]], rtol=0, atol=1e-6)
