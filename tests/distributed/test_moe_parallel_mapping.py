"""Qwen3-MoE under model parallelism: TP 2, PP 2 and EP 2 (world 2), EP 2 x TP 2 (world 4) over gloo.

The reference is transformers' ``Qwen3MoeForCausalLM`` on the full model in one process, in
float64 (eager experts loop). Megatron's EP ranks are data-parallel replicas for the dense part,
so each replica feeds its own batch (seeded by its data-parallel rank, and of its own length: 6
tokens per row on replica 0, 4 on replica 1, as RL micro-batches padded to their own longest row)
and the all-gather token dispatcher brings both replicas' tokens to every expert (padded to equal
counts, ``nemo_sspo.megatron.moe.even_token_dispatch``); each rank's logits are checked against
the reference on its own batch. Layouts (tp, ep, pp): (1, 2, 1), (2, 1, 1), (1, 1, 2) at world 2
and (2, 2, 1) at world 4. Checks per layout:

1. the TP-gathered fp32 logits equal the float64 reference (rtol/atol 1e-5);
2. each EP rank holds only its block of experts (global ids ``ep_rank * E / EP + i``), loaded from
   the per-expert HF names;
3. ``export_hf_state_dict`` returns exactly the HF tensors (bit-equal, all 8 experts of every
   layer on every replica), and the streamed refit (one unit per bucket) yields the same tensors;
   the streamed export holds at most one layer's experts per bucket;
4. ``parameter_counts`` (one meta-device build) predicts each rank's real parameter count.

Router weights are redrawn with std 0.5 so routes depend on the token; a dispatcher or an expert
numbering that sent a token to another expert moves the logits far beyond the tolerance.
"""

import torch
import torch.distributed as dist
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from nemo_sspo.megatron import export_hf_state_dict, iter_hf_weight_buckets, parameter_counts
from nemo_sspo.megatron.router_replay import stage_moe_layers
from nemo_sspo.models import split_expert_weights
from tests.distributed._megatron_layouts import full_vocab_logits, megatron_layout
from tests.unit.mapping_cases import TINY_MOE, VOCAB, assert_same_tensors, float64_logits, megatron_copy, redraw_, relative_error

SEQ, BATCH, EXPERTS = 6, 2, TINY_MOE["num_experts"]


def _check_layout(tp: int, ep: int, pp: int = 1) -> dict:
    torch.manual_seed(1234)  # the same HF weights on every rank
    hf_model = redraw_(Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY_MOE)).eval())
    config, hf_state = hf_model.config, split_expert_weights(hf_model.state_dict())
    predicted = parameter_counts(config, tp_size=tp, pp_size=pp, ep_size=ep)  # meta build, before the real one
    with megatron_layout(tp, pp, ep) as groups:
        assert groups.ep_size == ep and groups.dp_size == dist.get_world_size() // (tp * pp)  # EP splits DP
        seq = SEQ - 2 * groups.dp_rank  # unequal token counts across the EP group
        ids = torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(10 + groups.dp_rank))
        expected = float64_logits(hf_model, ids)
        model = megatron_copy(config, hf_state)
        assert sum(p.numel() for p in model.parameters()) == predicted[groups.pp_rank][groups.tp_rank]
        # router replay R3: each stage takes its own layers of the engine's [B, S, L_all, k] routes
        # (2 layers: both at PP 1; layer 0 on stage 0 and layer 1 on stage 1 at PP 2)
        per_stage = 2 // pp
        assert stage_moe_layers(model) == list(range(groups.pp_rank * per_stage, (groups.pp_rank + 1) * per_stage))
        local, layer = EXPERTS // ep, model.decoder.layers[-1]
        fc2 = layer.mlp.experts.local_experts[local - 1].linear_fc2.weight
        last_expert = groups.ep_rank * local + local - 1
        down = hf_state[f"model.layers.{layer.layer_number - 1}.mlp.experts.{last_expert}.down_proj.weight"]
        assert torch.equal(fc2, down.chunk(tp, dim=1)[groups.tp_rank])
        full = full_vocab_logits(model, ids)
        torch.testing.assert_close(full[..., :VOCAB].double(), expected, atol=1e-5, rtol=1e-5)
        exported = export_hf_state_dict(model, config)
        streamed, most_experts = {}, 0
        for bucket in iter_hf_weight_buckets(model, config, bucket_bytes=1):  # one unit per bucket
            most_experts = max(most_experts, sum(".mlp.experts." in name for name in bucket))
            streamed.update(bucket)
        assert_same_tensors(exported, hf_state, f"(tp={tp}, ep={ep})")
        if dist.get_rank() == groups.mp_src_rank:  # the streamed refit reaches the engine rank only
            assert_same_tensors(streamed, hf_state, f"streamed (tp={tp}, ep={ep})")
            assert most_experts == 3 * EXPERTS  # one layer's experts (gate, up, down each)
        return {"rel_diff": relative_error(full[..., :VOCAB], expected)}


def _world_2(rank: int, world_size: int) -> dict:
    return {layout: _check_layout(*layout) for layout in ((1, 2, 1), (2, 1, 1), (1, 1, 2))}  # (tp, ep, pp)


def _ep2_tp2(rank: int, world_size: int) -> dict:
    return _check_layout(tp=2, ep=2)


def test_ep2_tp2_and_pp2_logits_export_and_streamed_refit(run_distributed):
    results = run_distributed(_world_2, 2, timeout_s=400)
    assert all(len(result) == 3 for result in results)
    assert all(value["rel_diff"] < 1e-5 for result in results for value in result.values()), results


def test_ep2_x_tp2_logits_export_and_streamed_refit(run_distributed):
    results = run_distributed(_ep2_tp2, 4, timeout_s=300)
    assert all(result["rel_diff"] < 1e-5 for result in results), results
