"""Qwen3 dense in the HF <-> Megatron mapping (single process).

Reference: transformers' ``Qwen3ForCausalLM`` on the same weights in float64. Qwen3 differs from
Llama by an RMSNorm over ``head_dim`` on every query and key head before RoPE (HF ``q_norm`` /
``k_norm``, Megatron ``qk_layernorm``) and by a ``head_dim`` set apart from hidden / heads. The norm
weights are redrawn around 1 (transformers sets them to 1), so a dropped or swapped q/k norm changes
the logits by ~0.1, far above the 1e-5 tolerance; a wrong ``kv_channels`` fails at load (shapes).
"""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from nemo_sspo.megatron import export_hf_state_dict, forward_logits, transformer_config_from_hf
from nemo_sspo.megatron.hf_mapping import expected_hf_keys
from tests.unit.mapping_cases import TINY, VOCAB, assert_same_tensors, float64_logits, megatron_copy, redraw_, relative_error, tiny_random_case

SEQ = 7


def _config(tied: bool = False, **overrides) -> Qwen3Config:
    return Qwen3Config(**(TINY | dict(head_dim=24, tie_word_embeddings=tied) | overrides))  # 24 != 64 / 4


def _hf_model(config: Qwen3Config) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    return redraw_(Qwen3ForCausalLM(config).eval())


@pytest.mark.parametrize("tied", [False, True])
def test_qwen3_logits_match_float64_transformers_and_export_round_trips(parallel_1, tied):
    config = _config(tied)
    hf_model = _hf_model(config)
    model = megatron_copy(config, hf_model.state_dict())
    assert model.config.qk_layernorm and model.config.kv_channels == 24
    assert not (model.config.add_qkv_bias or model.config.add_bias_linear)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = forward_logits(model, ids, torch.arange(SEQ).expand(2, SEQ))[..., :VOCAB]
    assert relative_error(logits, float64_logits(hf_model, ids)) < 1e-5  # fp32 against float64
    assert_same_tensors(export_hf_state_dict(model, config), hf_model.state_dict())  # q/k norms included


def test_qwen3_keys_include_qk_norms_and_no_biases():
    keys = expected_hf_keys(_config(num_hidden_layers=1))
    # embed + 11 per layer (q, k, v, o, q_norm, k_norm, gate, up, down, 2 norms) + norm + lm_head
    assert len(keys) == 14
    assert keys[4:7] == ["model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.q_norm.weight",
                         "model.layers.0.self_attn.k_norm.weight"]
    assert not any(key.endswith(".bias") for key in keys)


def test_load_rejects_state_dict_without_k_norm(parallel_1):
    config = _config()
    state = {k: v for k, v in _hf_model(config).state_dict().items() if "layers.1.self_attn.k_norm" not in k}
    with pytest.raises(ValueError, match=r"missing=\['model.layers.1.self_attn.k_norm.weight'\]"):
        megatron_copy(config, state)


def test_qwen3_attention_bias_is_refused():
    with pytest.raises(ValueError, match="attention_bias=True is not supported: the qwen3 mapping"):
        transformer_config_from_hf(_config(attention_bias=True), tp_size=1, pp_size=1)


def test_tiny_random_qwen3_source_matches_megatron(parallel_1):
    case = tiny_random_case("tiny-random-qwen3")
    assert (case.config.model_type, case.config.tie_word_embeddings, case.config.vocab_size,
            case.config.head_dim) == ("qwen3", True, 151936, 32)
    assert "lm_head.weight" not in case.state_dict  # tied: the output layer is the embedding
    q_norm = case.state_dict["model.layers.0.self_attn.q_norm.weight"]
    assert q_norm.shape == (32,) and (q_norm - 1).abs().max() > 0.05  # redrawn around 1
    assert relative_error(case.logits, float64_logits(case.hf_model, case.ids)) < 1e-5
