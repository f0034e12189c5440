"""Qwen3-MoE in the HF <-> Megatron mapping at expert parallelism 1 (single process).

Reference: transformers' ``Qwen3MoeForCausalLM`` on the same weights in float64 (its eager experts
loop: the grouped-mm default has no float64 kernel). The router weights are redrawn with std 0.5
(transformers' 0.02 leaves the routing near uniform), so routes depend on the token and a wrong
top-k rule moves the logits: the two ``norm_topk_prob`` settings give logits 5.5e-3 apart (relative
to their scale) on these weights, 550 times the 1e-5 tolerance.
"""

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from nemo_sspo.megatron import export_hf_state_dict, forward_logits, transformer_config_from_hf
from nemo_sspo.megatron.hf_mapping import expected_hf_keys
from nemo_sspo.models import build_hf_model, fuse_expert_weights, split_expert_weights
from tests.unit.mapping_cases import (
    TINY,
    TINY_MOE,
    VOCAB,
    assert_same_tensors,
    float64_logits,
    megatron_copy,
    redraw_,
    relative_error,
    tiny_random_case,
)

SEQ, EXPERTS = 7, 4


def _config(**overrides) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(**(TINY_MOE | dict(moe_intermediate_size=40, num_experts=EXPERTS) | overrides))


def _hf_model(config: Qwen3MoeConfig) -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    return redraw_(Qwen3MoeForCausalLM(config).eval())


def test_logits_match_float64_transformers_for_both_top_k_rules_and_export_round_trips(parallel_1):
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    logits = {}
    for norm_topk in (True, False):
        config = _config(norm_topk_prob=norm_topk)
        hf_model = _hf_model(config)
        state = split_expert_weights(hf_model.state_dict())
        model = megatron_copy(config, state)
        # norm_topk_prob=True: top-k of the logits, then softmax over those k (no pre-softmax)
        assert model.config.moe_router_pre_softmax is not norm_topk
        assert (model.config.num_moe_experts, model.config.moe_router_topk, model.config.moe_ffn_hidden_size) == (
            EXPERTS, 2, 40)
        with torch.no_grad():
            logits[norm_topk] = forward_logits(model, ids, torch.arange(SEQ).expand(2, SEQ))[..., :VOCAB]
        expected = float64_logits(hf_model, ids)
        assert relative_error(logits[norm_topk], expected) < 1e-5, norm_topk
        assert list(state) == expected_hf_keys(config)
        assert_same_tensors(export_hf_state_dict(model, config), state)
    # The two rules route the same weights to differently weighted experts: the test sees a swap.
    assert relative_error(logits[True], logits[False].double()) > 1e-3


def test_expert_names_are_what_save_pretrained_writes_and_from_pretrained_reads(tmp_path):
    config = _config(num_hidden_layers=1)
    hf_model = _hf_model(config)
    ours = split_expert_weights(hf_model.state_dict())
    hf_model.save_pretrained(tmp_path / "saved")
    on_disk = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert set(on_disk) == set(ours) == set(expected_hf_keys(config))
    for name, tensor in ours.items():
        assert torch.equal(on_disk[name], tensor), name
    # From our names back into transformers, in memory and through from_pretrained.
    fused = fuse_expert_weights(ours)
    assert list(fused) == list(hf_model.state_dict())
    for name, tensor in hf_model.state_dict().items():
        assert torch.equal(fused[name], tensor), name
    assert torch.equal(build_hf_model(config, ours).model.layers[0].mlp.experts.gate_up_proj,
                       hf_model.model.layers[0].mlp.experts.gate_up_proj)
    loaded = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "saved")
    assert torch.equal(loaded.model.layers[0].mlp.experts.down_proj, hf_model.model.layers[0].mlp.experts.down_proj)


def test_fuse_refuses_a_layer_with_a_missing_projection():
    state = split_expert_weights(_hf_model(_config(num_hidden_layers=1)).state_dict())
    del state["model.layers.0.mlp.experts.2.up_proj.weight"]
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts is missing expert projections \[\(2, 'up_proj'\)\]"):
        fuse_expert_weights(state)


@pytest.mark.parametrize(("overrides", "ep_size", "message"), [
    (dict(decoder_sparse_step=2), 1, "decoder_sparse_step=2 / mlp_only_layers=\\[\\] is not supported"),
    (dict(mlp_only_layers=[1]), 1, "mlp_only_layers=\\[1\\] is not supported"),
    ({}, 3, "num_experts=4 is not divisible by ep_size=3"),
])
def test_unsupported_moe_layouts_are_refused(overrides, ep_size, message):
    with pytest.raises(ValueError, match=message):
        transformer_config_from_hf(_config(**overrides), tp_size=1, pp_size=1, ep_size=ep_size)


def test_expert_parallelism_on_a_dense_model_is_refused():
    from transformers import Qwen3Config

    dense = Qwen3Config(**TINY)
    with pytest.raises(ValueError, match="^ep_size=2 needs a mixture-of-experts model"):
        transformer_config_from_hf(dense, tp_size=1, pp_size=1, ep_size=2)


def test_tiny_random_qwen3_moe_source_matches_megatron(parallel_1):
    case = tiny_random_case("tiny-random-qwen3-moe")
    config = case.config
    assert (config.model_type, config.num_experts, config.num_experts_per_tok, config.norm_topk_prob,
            config.head_dim) == ("qwen3_moe", 8, 2, True, 32)
    router = case.state_dict["model.layers.0.mlp.gate.weight"]
    assert router.shape == (8, 64) and 0.4 < float(router.std()) < 0.6  # redrawn with std 0.5
    assert relative_error(case.logits, float64_logits(case.hf_model, case.ids)) < 1e-5
