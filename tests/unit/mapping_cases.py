"""Tiny HF models and their references, shared by the HF <-> Megatron mapping tests (unit and
distributed) and the router-replay tests.

Weights are redrawn away from transformers' init (:func:`redraw_`), so a dropped, permuted or
swapped tensor moves the logits far beyond the tests' 1e-5 tolerance.
"""

from typing import Any, NamedTuple

import torch

VOCAB = 100

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=False, max_position_embeddings=32,
            rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
"""The dense shape every mapping test starts from (vocab 100 pads to 128 * tp rows)."""

TINY_MOE = TINY | dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                       head_dim=32)
"""A Qwen3-MoE on :data:`TINY`: 8 experts, top-2."""


def redraw_(model: torch.nn.Module) -> torch.nn.Module:
    """Redraws ``model``'s weights in place from the global RNG and returns it: biases N(0, 0.5)
    (transformers zero-initialises them), norm weights N(1, 0.3) (set to 1) and MoE router weights
    N(0, 0.5) (transformers' std 0.02 leaves the routing near uniform, so routes would hardly
    depend on the token).
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5)
            elif "norm" in name:
                param.normal_(1.0, 0.3)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
    return model


def float64_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits of a float64 copy of ``model`` (``model`` is left as it is)."""
    reference = type(model)(model.config).eval()
    reference.load_state_dict(model.state_dict())
    reference.config._experts_implementation = "eager"  # MoE: grouped_mm has no float64 kernel
    with torch.no_grad():
        return reference.double()(ids).logits


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| relative to the logits' scale, max |expected| (in float64)."""
    return float((actual.double() - expected).abs().max() / expected.abs().max())


def megatron_copy(config, state_dict: dict[str, torch.Tensor]):
    """A Megatron GPTModel of ``config`` (eval mode) holding ``state_dict`` (HF names, fp32; fused
    MoE experts are split into per-expert names first)."""
    from nemo_sspo.megatron import build_policy_model, load_hf_into_megatron
    from nemo_sspo.models import split_expert_weights

    model = build_policy_model(config).eval()
    load_hf_into_megatron(model, split_expert_weights(state_dict), config)
    return model


class TinyRandomCase(NamedTuple):
    """A built-in tiny random checkpoint on one math sentence (:func:`tiny_random_case`)."""

    config: Any
    state_dict: dict[str, torch.Tensor]
    tokenizer: Any
    hf_model: torch.nn.Module
    ids: torch.Tensor  # [1, S]
    logits: torch.Tensor  # [1, S, V]: Megatron's fp32 logits, vocabulary padding cut off


def tiny_random_case(source: str) -> TinyRandomCase:
    """Megatron's logits of a built-in tiny random checkpoint, with the HF model to compare them with."""
    from nemo_sspo.megatron import forward_logits
    from nemo_sspo.models import build_hf_model, load_hf_checkpoint

    config, state_dict, tokenizer = load_hf_checkpoint(source)
    model = megatron_copy(config, state_dict)
    ids = tokenizer(["Let x = 2.\n\nThen 2x = 4."], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = forward_logits(model, ids, torch.arange(ids.shape[1]).expand_as(ids))[..., :config.vocab_size]
    return TinyRandomCase(config, state_dict, tokenizer, build_hf_model(config, state_dict), ids, logits)


def assert_same_tensors(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], where: str = "") -> None:
    """``actual`` holds exactly ``expected``'s names, in its order, each tensor bit-equal (an export
    against the HF state dict it was loaded from); ``where`` is added to failure messages."""
    assert list(actual) == list(expected), where
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), f"{name} {where}"
