"""LoRA training is the same under every parallel layout: three optimizer steps of the adapters.

Each layout builds the tiny tied Llama of ``test_invariance`` with rank-4 adapters on all four
linear layers, loads the same HF weights and takes three steps on that test's batch (off-policy
noise on the old log-probs, so the ratios move and some clip), once with SSPO (segment-level
ratios) and once with GRPO (token-level). After each step it records the loss and the merged HF
weights (``W + (alpha / r) B A``, gathered over TP and PP by the weight export the refit uses), and
at the end the adapters by HF module (the PEFT export, gathered the same way). Every layout must give
the single-process run's losses, weight updates and adapters to rel 1e-5: TP 2, TP 2 with sequence
parallelism, PP 2 (tied embeddings on two stages) and DP 2 with the distributed optimizer. The tiny
Qwen3-MoE (8 experts, top-2, an adapter on each expert's fc1 and fc2) takes the same three steps at
EP 2 x TP 2 with sequence parallelism (world 4: each replica holds 4 experts and its own rows), with
and without the distributed optimizer, against its single process; each expert's adapter is
compared by its global expert index.

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
# model -> world -> (tp, pp, ep, sequence parallel, distributed optimizer); DP = world / (tp * pp)
LAYOUTS = {"llama": {1: [(1, 1, 1, False, False)],
                     2: [(2, 1, 1, False, False), (2, 1, 1, True, False), (1, 2, 1, False, False),
                         (1, 1, 1, False, True)]},
           "qwen3_moe": {1: [(1, 1, 1, False, False)], 4: [(2, 1, 2, True, False), (2, 1, 2, True, True)]}}
REFERENCE = (1, 1, 1, 1, False, False)  # (tp, pp, ep, dp, sp, distributed)


def _model_data(model: str):
    """``test_invariance``'s HF weights, batch and noise; for ``qwen3_moe`` the tiny Qwen3-MoE of the
    mapping tests (routers redrawn so routes depend on the token) at that test's vocabulary.
    """
    hf_config, hf_state, batch, noise = _fixture_data()
    if model == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        from nemo_sspo.models import split_expert_weights
        from tests.unit.mapping_cases import TINY_MOE, redraw_

        torch.manual_seed(1234)
        shape = TINY_MOE | dict(vocab_size=hf_config.vocab_size, max_position_embeddings=64)
        hf = redraw_(Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape)).eval())
        hf_config, hf_state = hf.config, split_expert_weights(hf.state_dict())
    return hf_config, hf_state, batch, noise


def _train(rank, world_size, model_name):
    from nemo_sspo.algorithms.micro_batches import MicroBatchLayout
    from nemo_sspo.megatron import (build_policy_model, destroy_parallel, export_hf_adapters, export_hf_state_dict,
                                    get_parallel_groups, initialize_parallel, load_hf_into_megatron, vocab_shard)
    from nemo_sspo.megatron.lora import LoraSettings, adapter_parameters
    from nemo_sspo.megatron.step import LossSpec
    from nemo_sspo.megatron.training import compute_old_logprobs, train_on_batch, wrap_for_training
    from nemo_sspo.parallel.metric_reduce import reduce_metric_sums

    hf_config, hf_state, batch, noise = _model_data(model_name)
    settings = LoraSettings(rank=RANK, alpha=ALPHA, dropout=0.0,
                            targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"), seed=5)
    results = {}
    for tp, pp, ep, sp, distributed in LAYOUTS[model_name][world_size]:
        dp = world_size // (tp * pp)
        for name, (registered, loss_config) in LOSSES.items():
            initialize_parallel(tp_size=tp, pp_size=pp, ep_size=ep, seed=0)
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
            results[(model_name, tp, pp, ep, dp, sp, distributed, name)] = dict(
                losses=losses, weights=weights, frozen_moved=frozen_moved, adapters=export_hf_adapters(model, hf_config),
                buffers_are_adapters=buffered == {id(p) for p in adapters.values()},
                optimized=optimized, dp=dp, ep=ep, distributed=distributed,
                dense_numel=sum(p.numel() for p in adapters.values() if p.allreduce),
                expert_numel=sum(p.numel() for p in adapters.values() if not p.allreduce))
            destroy_parallel()
    return results if rank == 0 else None


@pytest.fixture(scope="module")
def lora_runs(run_distributed):
    results = {}
    for model, worlds in LAYOUTS.items():
        for world in worlds:
            results.update(run_distributed(_train, world, model, timeout_s=600)[0])
    return results


def _updates(run: dict, base: dict) -> list[dict[str, torch.Tensor]]:
    """Each step's merged weights minus the HF weights the run started from."""
    return [{key: weights[key].double() - base[key].double() for key in base} for weights in run["weights"]]


def _runs():
    return [(model, tp, pp, ep, world // (tp * pp), sp, distributed, loss) for model, worlds in LAYOUTS.items()
            for world, layouts in worlds.items() for tp, pp, ep, sp, distributed in layouts for loss in LOSSES]


@pytest.mark.parametrize("run", [run for run in _runs() if run[1:7] != REFERENCE])
def test_three_lora_steps_match_the_single_process(lora_runs, run):
    _, hf_state, _, _ = _model_data(run[0])
    reference, got = lora_runs[(run[0], *REFERENCE, run[-1])], lora_runs[run]
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
    _, hf_state, _, _ = _model_data(run[0])
    got = lora_runs[run]
    assert got["frozen_moved"] == []
    assert got["buffers_are_adapters"]
    # The distributed optimizer keeps this rank's 1/DP of the adapters' buffer, and 1/(DP / EP) of the
    # expert adapters' (Megatron pads each buffer, so the share is at least the even split).
    dp, expert_dp = (got["dp"], got["dp"] // got["ep"]) if got["distributed"] else (1, 1)
    share = got["dense_numel"] / dp + got["expert_numel"] / expert_dp
    assert share <= got["optimized"] <= share + 64 * (dp + expert_dp)
    first = _updates(got, hf_state)[0]
    adapted = [key for key in first if first[key].abs().max() > 0]
    # every adapted HF weight moved at step 1 (q/k/v, o, gate/up, down of every layer); nothing else did.
    # An expert moves iff some token was routed to it in step 1: all three of its weights, or none.
    expected = sorted(key for key in hf_state if key.endswith(
        ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight", "up_proj.weight",
         "down_proj.weight")))
    if run[0] == "qwen3_moe":
        experts = {key.rsplit(".", 2)[0] for key in adapted if ".mlp.experts." in key}
        assert len(experts) >= 8, sorted(experts)  # of the 16 (2 layers x 8 experts)
        expected = [key for key in expected if ".mlp.experts." not in key or key.rsplit(".", 2)[0] in experts]
    assert sorted(adapted) == expected
