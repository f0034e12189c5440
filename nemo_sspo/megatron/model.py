"""Megatron-Core ``GPTModel`` built from a Hugging Face Llama-architecture config.

Vocabulary padding follows Megatron-LM's rule (``_vocab_size_with_padding``): the vocabulary is
padded up to a multiple of ``MAKE_VOCAB_SIZE_DIVISIBLE_BY * tp_size`` (128 * tp), so every TP
shard has ``V_local = V_padded / tp`` rows. Padded rows of the embedding and output layer are zero
(see ``hf_mapping``), so their logits are exactly 0 and consumers must mask them by
``vocab_shard``'s true vocabulary size. SmolLM2-135M: 49,152 = 128 * 384, no padding at TP 1 or 3.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from nemo_sspo.megatron.cpu_shims import (
    attention_mask_for,
    cpu_config_overrides,
    cpu_device_context,
    needs_cpu_shims,
)
from nemo_sspo.megatron.parallel_setup import get_parallel_groups

__all__ = [
    "MAKE_VOCAB_SIZE_DIVISIBLE_BY",
    "build_policy_model",
    "forward_logits",
    "padded_vocab_size",
    "transformer_config_from_hf",
    "unwrap_model",
    "vocab_shard",
]

MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """Megatron-LM's padded vocabulary: smallest multiple of ``128 * tp_size`` >= ``vocab_size``."""
    multiple = MAKE_VOCAB_SIZE_DIVISIBLE_BY * tp_size
    return math.ceil(vocab_size / multiple) * multiple


def _rope_theta(hf_config: Any) -> float:
    """RoPE base from transformers 5 ``rope_parameters`` (or the older ``rope_theta`` field)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(
            f"hf_config.rope_parameters['rope_type']={rope_type!r} is not supported: only plain "
            "RoPE ('default') maps onto Megatron's rotary embedding here"
        )
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("hf_config has neither rope_parameters['rope_theta'] nor rope_theta")
    return float(theta)


def _head_dim(hf_config: Any) -> int:
    head_dim = getattr(hf_config, "head_dim", None)
    return int(head_dim) if head_dim else hf_config.hidden_size // hf_config.num_attention_heads


def _validate_llama(hf_config: Any, tp_size: int, pp_size: int) -> None:
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(
            f"hf_config.hidden_act={hf_config.hidden_act!r}: only 'silu' (SwiGLU) is supported"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(hf_config, flag, False):
            raise ValueError(f"hf_config.{flag}=True is not supported: Llama mapping has no biases")
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    for field, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if count % tp_size:
            raise ValueError(
                f"{field}={count} is not divisible by tp_size={tp_size}: "
                "choose a tp_size dividing it"
            )
    if hf_config.num_hidden_layers % pp_size:
        raise ValueError(
            f"num_hidden_layers={hf_config.num_hidden_layers} is not divisible by "
            f"pp_size={pp_size}: choose a pp_size dividing it"
        )


def transformer_config_from_hf(
    hf_config: Any, *, tp_size: int, pp_size: int, params_dtype: torch.dtype = torch.float32
):
    """Megatron ``TransformerConfig`` equivalent to a HF Llama-architecture config.

    Maps GQA (num_query_groups = num_key_value_heads), SwiGLU (gated_linear_unit + silu), RMSNorm
    (eps = rms_norm_eps), no biases, kv_channels = head_dim, dropout 0; CPU shims add their
    overrides (fp32 pipeline p2p, no fused kernels) when no GPU is present. The rotary base is not
    a TransformerConfig field: ``build_policy_model`` passes it to ``GPTModel``.

    Raises:
        ValueError: naming the field, when num_attention_heads or num_key_value_heads is not
            divisible by tp_size, num_hidden_layers not divisible by pp_size, or the config uses
            biases, a non-silu activation or scaled RoPE.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    _validate_llama(hf_config, tp_size, pp_size)
    _rope_theta(hf_config)
    kwargs = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=_head_dim(hf_config),
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
    )
    kwargs.update(cpu_config_overrides())
    return TransformerConfig(**kwargs)


def _layer_spec(config):
    """Local (pure Megatron) layer spec on CPU; TransformerEngine spec on GPU, imported lazily."""
    if needs_cpu_shims():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return get_gpt_layer_local_spec(normalization=config.normalization)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return get_gpt_layer_with_transformer_engine_spec()


def build_policy_model(hf_config: Any, *, params_dtype: torch.dtype = torch.float32):
    """This rank's ``GPTModel`` stage for ``hf_config`` under the current parallel state.

    pre_process / post_process follow this rank's pipeline stage; embeddings and output layer are
    tied iff ``hf_config.tie_word_embeddings``; RoPE with base ``rope_theta``; vocabulary padded to
    a multiple of 128 * tp_size; ``max_sequence_length = max_position_embeddings``. Callers choose
    train/eval mode. Weights are random until
    ``hf_mapping.load_hf_into_megatron``. The true vocabulary size is kept on the model as
    ``model.true_vocab_size`` for ``vocab_shard``.

    Raises:
        ValueError: as ``transformer_config_from_hf``, or if parallel state is not initialised.
    """
    from megatron.core.models.gpt import GPTModel

    groups = get_parallel_groups()
    config = transformer_config_from_hf(
        hf_config, tp_size=groups.tp_size, pp_size=groups.pp_size, params_dtype=params_dtype
    )
    # Tied embeddings across pipeline stages move the weight with .cuda() for an all-reduce.
    with cpu_device_context():
        model = GPTModel(
            config=config,
            transformer_layer_spec=_layer_spec(config),
            vocab_size=padded_vocab_size(hf_config.vocab_size, groups.tp_size),
            max_sequence_length=hf_config.max_position_embeddings,
            pre_process=groups.is_first_stage,
            post_process=groups.is_last_stage,
            parallel_output=True,
            share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
            position_embedding_type="rope",
            rotary_base=_rope_theta(hf_config),
        )
    model.true_vocab_size = int(hf_config.vocab_size)
    return model


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside DDP / Float16Module wrappers (which expose it as ``.module``)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def vocab_shard(model: torch.nn.Module) -> tuple[int, int]:
    """``(vocab_start, vocab_size_true)`` of this rank's logits shard.

    Logits column ``j`` of this rank is global token id ``vocab_start + j``; ids >=
    ``vocab_size_true`` are Megatron padding and must get zero probability.

    Raises:
        ValueError: if ``model`` was not built by ``build_policy_model``.
    """
    gpt = unwrap_model(model)
    if not hasattr(gpt, "true_vocab_size"):
        raise ValueError("model has no true_vocab_size: build it with build_policy_model()")
    tp_size = gpt.config.tensor_model_parallel_size
    vocab_local = gpt.vocab_size // tp_size
    return get_parallel_groups().tp_rank * vocab_local, gpt.true_vocab_size


def _check_inputs(input_ids, position_ids, attention_mask) -> None:
    if input_ids.dim() != 2 or position_ids.shape != input_ids.shape:
        raise ValueError(
            f"input_ids and position_ids must both be [B, S], got {tuple(input_ids.shape)} and "
            f"{tuple(position_ids.shape)}"
        )
    arange = torch.arange(input_ids.shape[1], device=position_ids.device)
    # Megatron's RoPE uses positions 0..S-1 and ignores position_ids, so anything else would be
    # silently wrong (e.g. left padding with shifted positions).
    if not torch.equal(position_ids, arange.expand_as(position_ids)):
        raise ValueError("position_ids must be arange(S) in every row: use right padding")
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask must be [B, S] like input_ids, got {tuple(attention_mask.shape)}"
            )
        valid = attention_mask.bool()
        # Right padding: once a row has a padding position, every later one is padding.
        if (valid[:, 1:] & ~valid[:, :-1]).any():
            raise ValueError(
                "attention_mask has valid tokens after padding: only right padding is supported"
            )


def forward_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run this pipeline stage of ``model`` on one micro-batch.

    Args:
        model: GPTModel (optionally wrapped) from ``build_policy_model``.
        input_ids: [B, S] int64 token ids (read on the first stage only).
        position_ids: [B, S] int64, must equal arange(S) per row (right padding).
        attention_mask: optional [B, S] bool/int, 1 = real token, right padding only. Attention is
            causal, so padding only affects positions after a row's valid tokens; the mask is
            validated, not needed to compute the valid positions' logits.

    Returns:
        Last stage: logits [B, S, V_local] (GPTModel already transposes its sequence-first
        [S, B, V_local] to batch-first when no labels are given), float, V_local = V_padded / tp.
        Other stages: the stage's hidden states [S, B, H] (sequence-first), for the pipeline
        schedule to send on.

    Raises:
        ValueError: on bad shapes, non-arange position_ids or left padding.
    """
    _check_inputs(input_ids, position_ids, attention_mask)
    mask = attention_mask_for(input_ids.shape[1], input_ids.device)
    return model(input_ids, position_ids, mask)
