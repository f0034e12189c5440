"""LoRA training is the same under every parallel layout: three optimizer steps of the adapters.

Each layout builds the tiny tied Llama of ``test_invariance`` with rank-4 adapters on all four
linear layers, loads the same HF weights and takes three steps on that test's batch (off-policy
noise on the old log-probs, so the ratios move and some clip), once with SSPO (segment-level
ratios) and once with GRPO (token-level). After each step it records the loss and the merged HF
weights (``W + (alpha / r) B A``, gathered over TP and PP by the weight export the refit uses), and
at the end the adapters by HF module (the PEFT export, gathered the same way). Every layout must give
the single-process run's losses, weight updates and adapters to rel 1e-5: TP 2, TP 2 with sequence
parallelism, PP 2 (tied embeddings on two stages) and DP 2 with the distributed optimizer.

Each run also checks what LoRA promises of the wrapped model: only the adapters have gradient
buffers and optimizer states (the optimizer's parameters are exactly the adapter factors), the
base weights never move, and the merged update at step 1 is nonzero.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from nemo_sspo.algorithms.losses import GRPOLossConfig, SSPOLossConfig, make_policy_loss
from tests.distributed.test_invariance import MAX_RESPONSE_LENGTH, ROWS, TEMPERATURE, _fixture_data, _rel_err

RANK, ALPHA, LR, STEPS = 4, 8.0, 1e-2, 3
# Adam divides by sqrt(v) + eps: at eps 1e-8 a gradient element near 0 (float32 rounding, 1e-10) moves
# its weight by a sizeable part of lr with either sign, which no layout can reproduce. eps 1e-4 keeps
# the update a smooth function of the gradient.
ADAM_EPS = 1e-4
LOSSES = {"sspo": ("sspo", SSPOLossConfig(alpha=0.0, beta=0.8, gamma=1.1)),
          "grpo": ("grpo", GRPOLossConfig(eps_low=0.2, eps_high=0.2, dual_clip_c=None))}
# world -> (tp, pp, sequence parallel, distributed optimizer); DP = world / (tp * pp)
LAYOUTS = {1: [(1, 1, False, False)],
           2: [(2, 1, False, False), (2, 1, True, False), (1, 2, False, False), (1, 1, False, True)]}
REFERENCE = (1, 1, 1, False, False)


def _train(rank, world_size):
    from nemo_sspo.algorithms.micro_batches import MicroBatchLayout
    from nemo_sspo.megatron import (build_policy_model, destroy_parallel, export_hf_adapters, export_hf_state_dict,
                                    get_parallel_groups, initialize_parallel, load_hf_into_megatron, vocab_shard)
    from nemo_sspo.megatron.lora import LoraSettings, adapter_parameters
    from nemo_sspo.megatron.step import LossSpec
    from nemo_sspo.megatron.training import compute_old_logprobs, train_on_batch, wrap_for_training
    from nemo_sspo.parallel.metric_reduce import reduce_metric_sums

    hf_config, hf_state, batch, noise = _fixture_data()
    settings = LoraSettings(rank=RANK, alpha=ALPHA, dropout=0.0,
                            targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"), seed=5)
    results = {}
    for tp, pp, sp, distributed in LAYOUTS[world_size]:
        dp = world_size // (tp * pp)
        for name, (registered, loss_config) in LOSSES.items():
            initialize_parallel(tp_size=tp, pp_size=pp, seed=0)
            groups = get_parallel_groups()
            model = build_policy_model(hf_config, sequence_parallel=sp, lora=settings)
            load_hf_into_megatron(model, hf_state, hf_config)
            ddp, optimizer = wrap_for_training(model, lr=LR, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
                                               adam_eps=ADAM_EPS, clip_grad=1.0, use_distributed_optimizer=distributed)
            adapters = adapter_parameters(model)
            buffered = {id(p) for p in model.parameters() if hasattr(p, "main_grad")}
            optimized = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
            frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if n not in adapters}
            rows = ROWS // dp
            local = batch.select(slice(groups.dp_rank * rows, (groups.dp_rank + 1) * rows))
            local_noise = noise[groups.dp_rank * rows:(groups.dp_rank + 1) * rows]
            vocab_start, vocab_size = vocab_shard(model)
            spec = LossSpec(loss=make_policy_loss(registered, loss_config), tp_group=groups.tp_group if tp > 1 else None,
                            vocab_start=vocab_start, vocab_size=vocab_size, temperature=TEMPERATURE,
                            max_response_length=MAX_RESPONSE_LENGTH, output_chunk_size=3)
            layout = MicroBatchLayout(micro_batch_size=rows // 2 or 1, max_tokens=None, pack=False)
            losses, weights = [], []
            for _ in range(STEPS):
                scored = compute_old_logprobs(ddp, local, spec, layout, dp_group=groups.dp_group)
                scored = replace(scored, old_logprobs=scored.old_logprobs + local_noise)
                sums, _ = train_on_batch(ddp, optimizer, scored, spec, layout, dp_group=groups.dp_group)
                metrics = reduce_metric_sums(sums, dp_group=groups.dp_group, pp_group=groups.pp_group,
                                             last_stage_rank=groups.pp_last_rank, is_last_stage=groups.is_last_stage)
                losses.append(metrics["loss/policy"])
                weights.append(export_hf_state_dict(model, hf_config))
            frozen_moved = [n for n, p in model.named_parameters() if n not in adapters
                            and not torch.equal(p.detach(), frozen_before[n])]
            results[(tp, pp, dp, sp, distributed, name)] = dict(
                losses=losses, weights=weights, frozen_moved=frozen_moved, adapters=export_hf_adapters(model, hf_config),
                buffers_are_adapters=buffered == {id(p) for p in adapters.values()},
                optimized=optimized, adapter_numel=sum(p.numel() for p in adapters.values()), dp=dp,
                distributed=distributed)
            destroy_parallel()
    return results if rank == 0 else None


@pytest.fixture(scope="module")
def lora_runs(run_distributed):
    results = {}
    for world in LAYOUTS:
        results.update(run_distributed(_train, world, timeout_s=600)[0])
    return results


def _updates(run: dict, base: dict) -> list[dict[str, torch.Tensor]]:
    """Each step's merged weights minus the HF weights the run started from."""
    return [{key: weights[key].double() - base[key].double() for key in base} for weights in run["weights"]]


def _runs():
    return [(tp, pp, world // (tp * pp), sp, distributed, loss) for world, layouts in LAYOUTS.items()
            for tp, pp, sp, distributed in layouts for loss in LOSSES]


@pytest.mark.parametrize("run", [run for run in _runs() if run[:5] != REFERENCE])
def test_three_lora_steps_match_the_single_process(lora_runs, run):
    _, hf_state, _, _ = _fixture_data()
    reference, got = lora_runs[(*REFERENCE, run[-1])], lora_runs[run]
    for step, (ref_loss, loss) in enumerate(zip(reference["losses"], got["losses"])):
        assert math.isclose(loss, ref_loss, rel_tol=1e-5), (step, loss, ref_loss)
    for step, (ref_update, update) in enumerate(zip(_updates(reference, hf_state), _updates(got, hf_state))):
        for key, expected in ref_update.items():
            if expected.abs().max() > 0:
                assert _rel_err(update[key], expected) < 1e-5, (step, key)
            else:  # not adapted (norms, embeddings): exactly the base weight
                assert torch.equal(update[key], expected), (step, key)
    # The adapters by HF module (the PEFT export), gathered over TP and PP: the single process's.
    assert list(got["adapters"]) == list(reference["adapters"])
    for key, expected in reference["adapters"].items():
        assert _rel_err(got["adapters"][key], expected) < 1e-5, key


@pytest.mark.parametrize("run", _runs())
def test_only_adapters_train(lora_runs, run):
    _, hf_state, _, _ = _fixture_data()
    got = lora_runs[run]
    assert got["frozen_moved"] == []
    assert got["buffers_are_adapters"]
    # The distributed optimizer keeps this rank's 1/DP of the adapters' buffer (Megatron pads the
    # buffer, so the share is at least the even split).
    share = got["adapter_numel"] / (got["dp"] if got["distributed"] else 1)
    assert share <= got["optimized"] <= share + 64 * got["dp"]
    first = _updates(got, hf_state)[0]
    adapted = [key for key in first if first[key].abs().max() > 0]
    # every adapted HF weight moved at step 1 (q/k/v, o, gate/up, down of every layer); nothing else did
    assert sorted(adapted) == sorted(key for key in hf_state if key.endswith(
        ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight", "up_proj.weight",
         "down_proj.weight")))
