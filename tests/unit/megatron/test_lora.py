"""LoRA adapters on one process: a float64 hand check of one layer of each kind, a fresh adapter
equal to the base model for every model family (Qwen3-MoE with an adapter on each expert), the base
model read back with the adapters off, the merged export against transformers, the PEFT export
against ``peft``, and the refusals.

Multi-process layouts (TP, SP, PP, DP, EP x TP, distributed optimizer): tests/distributed/test_lora_invariance.py.
"""

import json

import pytest
import torch

from nemo_sspo.megatron import build_policy_model, export_hf_state_dict, forward_logits, load_hf_into_megatron
from nemo_sspo.megatron.lora import LoraSettings, adapter_parameters, adapters_disabled, lora_layers, with_adapters
from nemo_sspo.models import build_hf_model, load_hf_checkpoint

ALL = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
SETTINGS = LoraSettings(rank=3, alpha=6.0, dropout=0.0, targets=ALL, seed=4)


def _layer(target: str, in_features: int, out_features: int):
    """One adapted megatron-core linear layer of ``target``'s kind in float64, built from the local
    spec with :func:`with_adapters` (TP = 1), its weight and adapter factors drawn at random."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, params_dtype=torch.float64,
                               use_cpu_initialization=True)
    submodules = get_gpt_layer_local_spec().submodules
    with_adapters(submodules, LoraSettings(rank=3, alpha=6.0, dropout=0.0, targets=(target,)))
    owner = submodules.self_attention.submodules if target in ("linear_qkv", "linear_proj") else submodules.mlp.submodules
    options = dict(gather_output=False) if target in ("linear_qkv", "linear_fc1") else dict(input_is_parallel=True)
    layer = build_module(getattr(owner, target), in_features, out_features, config=config,
                         init_method=torch.nn.init.normal_, bias=False, skip_bias_add=False, **options)
    generator = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for parameter in (layer.weight, layer.lora_A, layer.lora_B):
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64))
    return layer


@pytest.mark.parametrize("target", ALL)
def test_one_layer_against_the_hand_formulas_in_float64(parallel_1, target):
    layer = _layer(target, 5, 7)
    s = 6.0 / 3
    x = torch.randn(4, 2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    upstream = torch.randn(4, 2, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    out, bias = layer(x)
    W, A, B = layer.weight.detach(), layer.lora_A.detach(), layer.lora_B.detach()
    assert bias is None
    torch.testing.assert_close(out, x.detach() @ (W + s * B @ A).T, rtol=1e-12, atol=1e-12)
    out.backward(upstream)
    tokens, grads = x.detach().reshape(-1, 5), upstream.reshape(-1, 7)
    # y = x W^T + s (x A^T) B^T: dL/dB = s G^T (x A^T), dL/dA = s (G B)^T x, dL/dx = G (W + s B A)
    torch.testing.assert_close(layer.lora_B.grad, s * grads.T @ (tokens @ A.T), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.lora_A.grad, s * (grads @ B).T @ tokens, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, upstream @ (W + s * B @ A), rtol=1e-12, atol=1e-12)
    assert layer.weight.grad is None and not layer.weight.requires_grad


@pytest.mark.parametrize("source", ["tiny-random-llama", "tiny-random-qwen2", "tiny-random-qwen3",
                                    "tiny-random-qwen3-moe"])
def test_a_fresh_adapter_is_the_base_model_and_merges_into_the_hf_weights(parallel_1, source):
    config, state_dict, tokenizer = load_hf_checkpoint(source)
    ids = tokenizer(["Let x = 2.\n\nThen 2x = 4."], return_tensors="pt")["input_ids"]
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    base = build_policy_model(config).eval()
    load_hf_into_megatron(base, state_dict, config)
    adapted = build_policy_model(config, lora=SETTINGS).eval()
    load_hf_into_megatron(adapted, state_dict, config)
    # per decoder layer: q/k/v, the attention output and fc1, fc2 of the MLP or of each expert (the router
    # takes none); A random, B zero, every other weight frozen
    mlps = getattr(config, "num_experts", 1)
    assert len(list(lora_layers(adapted))) == (2 + 2 * mlps) * config.num_hidden_layers
    assert {n for n, p in adapted.named_parameters() if p.requires_grad} == set(adapter_parameters(adapted))
    with torch.no_grad():
        expected = forward_logits(base, ids, positions)
        assert torch.equal(forward_logits(adapted, ids, positions), expected)  # B = 0: exactly the base model
        for name, factor in adapter_parameters(adapted).items():
            assert (factor.abs().max() > 0) == name.endswith("lora_A")
            if name.endswith("lora_B"):
                factor.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
        moved = forward_logits(adapted, ids, positions)
        with adapters_disabled(adapted):
            assert torch.equal(forward_logits(adapted, ids, positions), expected)  # the reference of a KL term
        assert (moved - expected).abs().max() > 1e-2
        # merged export, read by transformers: the adapted model's logits
        merged = export_hf_state_dict(adapted, config)
        if config.tie_word_embeddings:
            del merged["lm_head.weight"]  # transformers ties it to the embeddings itself
        hf_logits = build_hf_model(config, merged)(ids).logits
    scale = moved.abs().max()
    assert float((hf_logits - moved[..., :config.vocab_size]).abs().max() / scale) < 1e-5


def test_adapters_are_drawn_the_same_for_every_build(parallel_1):
    config, state_dict, _ = load_hf_checkpoint("tiny-random-llama")
    first, second = (build_policy_model(config, lora=SETTINGS) for _ in range(2))
    other_seed = build_policy_model(config, lora=LoraSettings(rank=3, alpha=6.0, dropout=0.0, targets=ALL, seed=5))
    for (name, a), b, c in zip(adapter_parameters(first).items(), adapter_parameters(second).values(),
                               adapter_parameters(other_seed).values()):
        assert torch.equal(a, b), name
        if name.endswith("lora_A"):
            bound = 1 / a.shape[1] ** 0.5  # Kaiming-uniform, a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))
            assert a.abs().max() <= bound and a.abs().max() > 0.9 * bound
            assert not torch.equal(a, c), name


def test_only_the_named_targets_get_adapters(parallel_1):
    config, _, _ = load_hf_checkpoint("tiny-random-llama")
    model = build_policy_model(config, lora=LoraSettings(rank=2, alpha=2.0, dropout=0.0, targets=("linear_fc2",)))
    assert [name for name, _ in lora_layers(model)] == [
        f"decoder.layers.{i}.mlp.linear_fc2" for i in range(config.num_hidden_layers)]


def test_grouped_gemm_experts_are_refused_naming_the_setting():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    submodules = get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=True).submodules
    with pytest.raises(ValueError, match=r"^lora\.target: the experts are megatron-core's GroupedMLP, whose weights "
                                         r"are not linear layers that take an adapter"):
        with_adapters(submodules, SETTINGS)


# (source, targets, the folder's target_modules, its lora_dropout) with adapters trained at dropout 0.1.
# Qwen3-MoE: peft 0.21 refuses dropout on transformers 5's fused expert parameters and silently drops a
# layer's gate/up expert adapters without down_proj ones, so the folder says dropout 0 and carries zero
# down_proj factors (measured: without them these logits were off by 5e-2).
PEFT_CASES = [
    ("tiny-random-qwen2", ALL, ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"], 0.1),
    ("tiny-random-qwen3-moe", ALL, ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"], 0.0),
    ("tiny-random-qwen3-moe", ("linear_fc1",), ["down_proj", "gate_proj", "up_proj"], 0.0),
]


@pytest.mark.parametrize("source, targets, modules, dropout", PEFT_CASES)
def test_the_peft_folder_loaded_by_peft_gives_the_products_logits(parallel_1, tmp_path, source, targets, modules,
                                                                  dropout):
    from peft import PeftModel

    from nemo_sspo.megatron import export_hf_adapters
    from nemo_sspo.models.hf_folder import PeftAdapter

    config, state_dict, tokenizer = load_hf_checkpoint(source)
    ids = tokenizer(["Let x = 2.\n\nThen 2x = 4."], return_tensors="pt")["input_ids"]
    settings = LoraSettings(rank=3, alpha=6.0, dropout=0.1, targets=targets, seed=4)
    adapted = build_policy_model(config, lora=settings).eval()
    load_hf_into_megatron(adapted, state_dict, config)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(3)
        for factor in adapter_parameters(adapted).values():
            factor.normal_(0.0, 0.05, generator=generator)
        expected = forward_logits(adapted, ids, torch.arange(ids.shape[1]).expand_as(ids))[..., :config.vocab_size]
    PeftAdapter(export_hf_adapters(adapted, config), rank=3, alpha=6.0, dropout=0.1,
                base_model=source).write(tmp_path / "adapter")
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (written["target_modules"], written["lora_dropout"]) == (modules, dropout)
    # transformers 5 holds a Qwen3-MoE layer's experts as fused 3-D parameters; peft moves the
    # per-expert adapters onto them (its target_parameters)
    model = PeftModel.from_pretrained(build_hf_model(config, state_dict), tmp_path / "adapter").eval()
    with torch.no_grad():
        got = model(ids).logits
        with model.disable_adapter():  # peft's base model is the product's reference model
            base = model(ids).logits
    assert float((got - expected).abs().max() / expected.abs().max()) < 1e-5
    assert (base - got).abs().max() > 1e-2
    if hasattr(config, "num_experts"):  # the experts' adapters count: without them the logits move
        with torch.no_grad():
            for name, factor in adapter_parameters(adapted).items():
                if ".mlp.experts." in name:
                    factor.zero_()
            without = forward_logits(adapted, ids, torch.arange(ids.shape[1]).expand_as(ids))[..., :config.vocab_size]
        assert (without - got).abs().max() > 1e-2
