"""Qwen2 in the HF <-> Megatron mapping (single process), and the layer-spec choice by environment.

Reference: transformers' Qwen2ForCausalLM on the same weights (fp32). Qwen2 differs from Llama by
q/k/v biases (fused into ``linear_qkv.bias`` in Megatron's grouped order); the 7B model also has an
untied output layer. Biases are redrawn non-zero (transformers initialises them to 0), so a
dropped or permuted bias changes the logits by ~0.1, far above the 1e-5 tolerance.
"""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from nemo_sspo.cli import load_config
from nemo_sspo.megatron import export_hf_state_dict, forward_logits, transformer_config_from_hf
from nemo_sspo.megatron import model as model_module
from nemo_sspo.megatron.hf_mapping import expected_hf_keys
from tests.unit.mapping_cases import TINY, VOCAB, assert_same_tensors, megatron_copy, redraw_, tiny_random_case

SEQ = 7


def _qwen2_config(tied: bool = False, **overrides) -> Qwen2Config:
    return Qwen2Config(**(TINY | dict(tie_word_embeddings=tied) | overrides))


def _hf_model(config: Qwen2Config) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return redraw_(Qwen2ForCausalLM(config).eval())


def _inputs(vocab: int = VOCAB):
    ids = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(5))
    return ids, torch.arange(SEQ).expand(2, SEQ)


@pytest.mark.parametrize("tied", [False, True])
def test_qwen2_logits_match_transformers_and_export_round_trips(parallel_1, tied):
    config = _qwen2_config(tied)
    hf_model = _hf_model(config)
    model = megatron_copy(config, hf_model.state_dict())
    assert model.config.add_qkv_bias and not model.config.add_bias_linear
    ids, positions = _inputs()
    with torch.no_grad():
        logits = forward_logits(model, ids, positions)[..., :VOCAB]
        torch.testing.assert_close(logits, hf_model(ids).logits, atol=1e-5, rtol=1e-5)
    assert_same_tensors(export_hf_state_dict(model, config), hf_model.state_dict())  # biases included


def test_qwen2_keys_include_qkv_biases():
    keys = expected_hf_keys(_qwen2_config(num_hidden_layers=1))
    # embed + 12 per layer (q/k/v weight+bias, o, gate, up, down, 2 norms) + norm + lm_head = 15
    assert len(keys) == 15
    assert keys[1:4] == ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias",
                         "model.layers.0.self_attn.k_proj.weight"]
    assert "model.layers.0.self_attn.o_proj.bias" not in keys  # Qwen2's o_proj has no bias


def test_load_rejects_state_dict_without_biases(parallel_1):
    config = _qwen2_config()
    state = {k: v for k, v in _hf_model(config).state_dict().items() if not k.endswith("v_proj.bias")}
    with pytest.raises(ValueError, match=r"missing=\['model.layers.0.self_attn.v_proj.bias'"):
        megatron_copy(config, state)


def test_tiny_random_qwen2_source_matches_megatron(parallel_1):
    case = tiny_random_case("tiny-random-qwen2")
    assert (case.config.model_type, case.config.tie_word_embeddings, case.config.vocab_size) == (
        "qwen2", False, 151936)
    assert len(case.tokenizer) <= case.config.vocab_size  # Qwen2.5: 151,936 rows for ~151.7k token ids
    assert case.state_dict["model.layers.0.self_attn.k_proj.bias"].abs().max() > 0  # non-zero biases
    with torch.no_grad():
        torch.testing.assert_close(case.logits, case.hf_model(case.ids).logits, atol=1e-5, rtol=1e-5)


def test_sliding_window_is_refused():
    with pytest.raises(ValueError, match="use_sliding_window"):
        transformer_config_from_hf(_qwen2_config(use_sliding_window=True, max_window_layers=1),
                                   tp_size=1, pp_size=1)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(precision="fp16"), "^precision='fp16' is unknown; valid: fp32, bf16"),
        (dict(precision="bf16", fp8="e5m2"), "^fp8='e5m2' is unknown"),
        (dict(precision="fp32", fp8="hybrid"), "^fp8='hybrid' needs precision='bf16'"),
        (dict(precision="bf16", fp8="hybrid", fp8_recipe="fancy"), "^fp8_recipe='fancy' is unknown"),
    ],
)
def test_precision_settings_are_checked_with_their_argument(kwargs, fragment):
    # The model layer names its own arguments; the config layer adds the key path (next test).
    with pytest.raises(ValueError, match=fragment):
        transformer_config_from_hf(_qwen2_config(), tp_size=1, pp_size=1, **kwargs)


@pytest.mark.parametrize(
    "override, fragment",
    [("model.precision=fp16", "model.precision='fp16' is unknown"),
     ("model.fp8=hybrid", "model.fp8='hybrid' needs precision='bf16'"),
     ("model.transformer_impl=te", "model.transformer_impl='te' is unknown")],
)
def test_precision_settings_fail_at_load_with_their_key(override, fragment):
    with pytest.raises(ValueError, match=fragment):
        load_config(overrides=[override])


def test_bf16_fp8_reach_the_transformer_config():
    config = transformer_config_from_hf(_qwen2_config(), tp_size=1, pp_size=1, precision="bf16",
                                        fp8="hybrid", fp8_recipe="tensorwise")
    assert (config.params_dtype, config.bf16, config.fp8, config.fp8_recipe) == (
        torch.bfloat16, True, "hybrid", "tensorwise")


def _fake_env(monkeypatch, *, cuda: bool, te: bool) -> None:
    monkeypatch.setattr(model_module.torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(model_module, "_transformer_engine_installed", lambda: te)


def test_layer_impl_by_environment(monkeypatch):
    resolve = model_module.resolve_transformer_impl
    _fake_env(monkeypatch, cuda=False, te=False)
    assert resolve("auto") == "local"  # CPU: always the local spec
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve("transformer_engine")
    with pytest.raises(ValueError, match=r"model.fp8='hybrid' needs a CUDA device"):
        resolve("auto", fp8="hybrid")
    _fake_env(monkeypatch, cuda=True, te=True)
    assert resolve("auto") == "transformer_engine"
    assert resolve("local") == "local"
    with pytest.raises(ValueError, match="model.transformer_impl='local'"):
        resolve("local", fp8="hybrid")
    _fake_env(monkeypatch, cuda=True, te=False)
    with pytest.warns(UserWarning, match="transformer-engine is not installed"):
        assert resolve("auto") == "local"
    # A missing GPU package names the package and the config key that asked for it.
    with pytest.raises(ValueError, match=r"model.fp8='e4m3' needs the package transformer-engine"):
        resolve("auto", fp8="e4m3")
    with pytest.raises(ValueError, match=r"model.transformer_impl='transformer_engine' needs the package"):
        resolve("transformer_engine")
    with pytest.raises(ValueError, match="^transformer_impl='te' is unknown"):
        model_module.check_model_options(precision="fp32", fp8=None, fp8_recipe="delayed", transformer_impl="te")
