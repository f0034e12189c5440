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

from nemo_sspo.megatron import (
    build_policy_model,
    destroy_parallel,
    export_hf_state_dict,
    forward_logits,
    initialize_parallel,
    load_hf_into_megatron,
    transformer_config_from_hf,
)
from nemo_sspo.megatron.hf_mapping import expected_hf_keys
from nemo_sspo.models import build_hf_model, load_hf_checkpoint

VOCAB, SEQ = 100, 7


def _config(tied: bool = False, **overrides) -> Qwen3Config:
    fields = dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, vocab_size=VOCAB, tie_word_embeddings=tied,
        max_position_embeddings=32, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    fields.update(overrides)
    return Qwen3Config(**fields)


def _hf_model(config: Qwen3Config) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
    return model


@pytest.fixture(scope="module")
def parallel_1():
    initialize_parallel(tp_size=1, pp_size=1, seed=3)
    yield
    destroy_parallel()


def _float64_logits(model: Qwen3ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    reference = Qwen3ForCausalLM(model.config).eval()
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        return reference.double()(ids).logits


def _assert_relative(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # max |fp32 - float64| relative to the logits' scale
    rel = float((actual.double() - expected).abs().max() / expected.abs().max())
    assert rel < 1e-5, rel


@pytest.mark.parametrize("tied", [False, True])
def test_qwen3_logits_match_float64_transformers_and_export_round_trips(parallel_1, tied):
    config = _config(tied)
    hf_model = _hf_model(config)
    model = build_policy_model(config).eval()
    assert model.config.qk_layernorm and model.config.kv_channels == 24
    assert not (model.config.add_qkv_bias or model.config.add_bias_linear)
    load_hf_into_megatron(model, hf_model.state_dict(), config)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = forward_logits(model, ids, torch.arange(SEQ).expand(2, SEQ))[..., :VOCAB]
    _assert_relative(logits, _float64_logits(hf_model, ids))
    exported = export_hf_state_dict(model, config)
    assert list(exported) == list(hf_model.state_dict())  # HF order, q/k norms included
    for name, tensor in hf_model.state_dict().items():
        assert torch.equal(exported[name], tensor), name


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
        load_hf_into_megatron(build_policy_model(config), state, config)


def test_qwen3_attention_bias_is_refused():
    with pytest.raises(ValueError, match="attention_bias=True is not supported: the qwen3 mapping"):
        transformer_config_from_hf(_config(attention_bias=True), tp_size=1, pp_size=1)


def test_tiny_random_qwen3_source_matches_megatron(parallel_1):
    config, state_dict, tokenizer = load_hf_checkpoint("tiny-random-qwen3")
    assert (config.model_type, config.tie_word_embeddings, config.vocab_size, config.head_dim) == (
        "qwen3", True, 151936, 32)
    assert "lm_head.weight" not in state_dict  # tied: the output layer is the embedding
    q_norm = state_dict["model.layers.0.self_attn.q_norm.weight"]
    assert q_norm.shape == (32,) and (q_norm - 1).abs().max() > 0.05  # redrawn around 1
    hf_model = build_hf_model(config, state_dict)
    model = build_policy_model(config).eval()
    load_hf_into_megatron(model, state_dict, config)
    ids = tokenizer(["Let x = 2.\n\nThen 2x = 4."], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = forward_logits(model, ids, torch.arange(ids.shape[1]).expand_as(ids))[..., :config.vocab_size]
    _assert_relative(logits, _float64_logits(hf_model, ids))

