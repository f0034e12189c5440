"""Megatron-Core ``GPTModel`` built from a Hugging Face Llama, Qwen2, Qwen3 or Qwen3-MoE config.

Layer implementation by environment (``resolve_transformer_impl``): the TransformerEngine spec
(BF16, optional FP8 with a recipe from the config) when a CUDA device and the ``transformer-engine``
package are present, the local Megatron-Core spec otherwise (always on CPU). TransformerEngine is
imported only when its spec is built. Packed sequences run on both: the TransformerEngine spec takes
Megatron's THD layout (``PackedSeqParams``, :mod:`nemo_sspo.megatron.packed_seq`), the local spec
a block-diagonal causal mask (CPU only).

Vocabulary padding follows Megatron-LM's rule (``_vocab_size_with_padding``): the vocabulary is
padded up to a multiple of ``MAKE_VOCAB_SIZE_DIVISIBLE_BY * tp_size`` (128 * tp), so every TP
shard has ``V_local = V_padded / tp`` rows. Padded rows of the embedding and output layer are zero
(see ``hf_mapping``), so their logits are exactly 0 and consumers must mask them by
``vocab_shard``'s true vocabulary size. SmolLM2-135M: 49,152 = 128 * 384, no padding at TP 1 or 3.
"""

from __future__ import annotations

import importlib.util
import math
import warnings
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from nemo_sspo.algorithms.micro_batches import packed_positions
from nemo_sspo.choice import Choice
from nemo_sspo.megatron.cpu_shims import (
    attention_mask_for,
    cpu_config_overrides,
    cpu_device_context,
)
from nemo_sspo.megatron.lora import LoraSettings, adapter_parameters, initialize_adapters, with_adapters
from nemo_sspo.megatron.moe import even_token_dispatch, moe_config_kwargs, validate_moe
from nemo_sspo.megatron.packed_seq import packed_seq_params, padded_width, thd_alignment
from nemo_sspo.megatron.parallel_setup import destroy_parallel, get_parallel_groups, initialize_parallel
from nemo_sspo.megatron.sequence_parallel import SequenceParallelTorchNorm, gather_sequence, sequence_parallel_size
from nemo_sspo.parallel.context_parallel import zigzag_positions

__all__ = [
    "FP8_FORMATS",
    "check_model_options",
    "Fp8Recipe",
    "MAKE_VOCAB_SIZE_DIVISIBLE_BY",
    "PRECISIONS",
    "Precision",
    "Recompute",
    "RecomputeMethod",
    "SUPPORTED_MODEL_TYPES",
    "TransformerImpl",
    "build_policy_model",
    "forward_logits",
    "has_qk_norm",
    "has_qkv_bias",
    "model_type",
    "padded_vocab_size",
    "recompute_kwargs",
    "parameter_counts",
    "resolve_transformer_impl",
    "transformer_config_from_hf",
    "check_architecture",
    "unwrap_model",
    "uses_transformer_engine",
    "vocab_shard",
]

MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
"""HF ``model_type`` values the config translation and weight mapping cover."""


class Precision(Choice):
    """``model.precision``: the policy's parameter dtype (:data:`PRECISIONS`)."""

    fp32 = "fp32"
    bf16 = "bf16"


PRECISIONS = {Precision.fp32: torch.float32, Precision.bf16: torch.bfloat16}
"""``model.precision`` -> parameter dtype."""
FP8_FORMATS = ("e4m3", "hybrid")
"""``model.fp8`` values (Megatron ``TransformerConfig.fp8``); None disables FP8."""


class Fp8Recipe(Choice):
    """``model.fp8_recipe`` values (Megatron ``Fp8Recipe``; ``custom`` is not exposed)."""

    delayed = "delayed"
    tensorwise = "tensorwise"
    mxfp8 = "mxfp8"
    blockwise = "blockwise"


class TransformerImpl(Choice):
    """``model.transformer_impl`` values; see :func:`resolve_transformer_impl`."""

    auto = "auto"
    local = "local"
    transformer_engine = "transformer_engine"


class Recompute(Choice):
    """``parallel.recompute``: activation recomputation (:func:`recompute_kwargs`)."""

    none = "none"
    selective = "selective"
    full = "full"


class RecomputeMethod(Choice):
    """``parallel.recompute_method``: which layers ``full`` recomputation covers (:func:`recompute_kwargs`)."""

    uniform = "uniform"
    block = "block"


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """Megatron-LM's padded vocabulary: smallest multiple of ``128 * tp_size`` >= ``vocab_size``."""
    return padded_width(vocab_size, MAKE_VOCAB_SIZE_DIVISIBLE_BY * tp_size)


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


def model_type(hf_config: Any) -> str:
    """``hf_config.model_type`` (one of :data:`SUPPORTED_MODEL_TYPES`); configs without one are Llama.

    Raises:
        ValueError: an architecture the mapping does not cover, naming the supported ones.
    """
    kind = getattr(hf_config, "model_type", None) or "llama"
    if kind not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"hf_config.model_type={kind!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return kind


def has_qkv_bias(hf_config: Any) -> bool:
    """True for Qwen2 (biases on q/k/v, none on o_proj or the MLP); False for Llama and Qwen3."""
    return model_type(hf_config) == "qwen2"


def has_qk_norm(hf_config: Any) -> bool:
    """True for Qwen3 and Qwen3-MoE: an RMSNorm over ``head_dim`` applied to every query and key
    head before RoPE (HF ``q_norm`` / ``k_norm``; Megatron ``qk_layernorm``); False for Llama and Qwen2.
    """
    return model_type(hf_config) in ("qwen3", "qwen3_moe")


def check_architecture(hf_config: Any, tp_size: int, pp_size: int, *, ep_size: int = 1,
                       tp_name: str = "tp_size", pp_name: str = "pp_size", ep_name: str = "ep_size") -> None:
    """Checks that ``hf_config`` maps onto Megatron's GPTModel under a TP x PP (x EP) layout (the one
    copy of these checks; the config layer runs it at load time from the model's config.json alone).

    Args:
        hf_config: a transformers Llama / Qwen2 / Qwen3 / Qwen3-MoE config (only its fields are read).
        tp_size: tensor-parallel size.
        pp_size: pipeline-parallel size.
        ep_size: expert-parallel size (Qwen3-MoE only; 1 for dense models).
        tp_name: the name of ``tp_size`` in messages (the caller's argument or config key).
        pp_name: the name of ``pp_size`` in messages.
        ep_name: the name of ``ep_size`` in messages.

    Raises:
        ValueError: naming the field and the valid sizes, when num_attention_heads or
            num_key_value_heads is not divisible by ``tp_size``, num_hidden_layers not divisible by
            ``pp_size``; for an MoE layout the mapping does not cover (``validate_moe``); or for an
            unsupported architecture, Llama / Qwen3 biases, a non-silu activation, sliding-window
            attention or scaled RoPE.
    """
    kind = model_type(hf_config)
    validate_moe(hf_config, ep_size, ep_name=ep_name)
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(
            f"hf_config.hidden_act={hf_config.hidden_act!r}: only 'silu' (SwiGLU) is supported"
        )
    if kind in ("llama", "qwen3", "qwen3_moe"):
        for flag in ("attention_bias", "mlp_bias"):
            if getattr(hf_config, flag, False):
                raise ValueError(f"hf_config.{flag}=True is not supported: the {kind} mapping has "
                                 "no biases")
    if kind != "llama":  # Qwen2 / Qwen3: every layer must use full causal attention
        layer_types = set(getattr(hf_config, "layer_types", None) or ["full_attention"])
        if getattr(hf_config, "use_sliding_window", False) or layer_types != {"full_attention"}:
            raise ValueError(
                "hf_config.use_sliding_window=True (sliding-window layers) is not supported: Megatron's "
                "GPTModel here uses full causal attention in every layer"
            )
    _rope_theta(hf_config)
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    for field, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if count % tp_size:
            raise ValueError(
                f"{tp_name}={tp_size} does not divide the model's {field}={count} (heads {heads}, key/value "
                f"heads {kv_heads}): use one of {_divisors(math.gcd(heads, kv_heads))}"
            )
    layers = hf_config.num_hidden_layers
    if layers % pp_size:
        raise ValueError(
            f"{pp_name}={pp_size} does not divide the model's num_hidden_layers={layers}: use one of "
            f"{_divisors(layers)}"
        )


def _divisors(n: int) -> str:
    """``"1, 2, 4"`` for 4: the sizes that split ``n`` evenly."""
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_model_options(*, precision: str, fp8: str | None, fp8_recipe: str,
                        transformer_impl: str = "auto") -> torch.dtype:
    """Checks the model build options (the one copy of these checks; the config layer runs it at load
    time and prefixes the key path ``model.``); returns the parameter dtype of ``precision``.

    Raises:
        ValueError: an unknown name (lists the valid ones), or ``fp8`` without ``precision='bf16'``.
    """
    for name, value, valid in (("precision", precision, Precision), ("fp8_recipe", fp8_recipe, Fp8Recipe),
                               ("transformer_impl", transformer_impl, TransformerImpl)):
        if value not in tuple(valid):
            raise ValueError(f"{name}={value!r} is unknown; valid: {', '.join(valid)}")
    if fp8 is not None and fp8 not in FP8_FORMATS:
        raise ValueError(f"fp8={fp8!r} is unknown; valid: {', '.join(FP8_FORMATS)} (or null to disable FP8)")
    if fp8 is not None and precision != "bf16":
        raise ValueError(f"fp8={fp8!r} needs precision='bf16' (FP8 GEMMs run inside a BF16 model), "
                         f"got precision={precision!r}")
    return PRECISIONS[precision]


def transformer_config_from_hf(
    hf_config: Any,
    *,
    tp_size: int,
    pp_size: int,
    precision: str = "fp32",
    fp8: str | None = None,
    fp8_recipe: str = "delayed",
    ep_size: int = 1,
    recompute: str = "none",
    recompute_method: str = "uniform",
    recompute_num_layers: int = 1,
    sequence_parallel: bool = False,
    cp_size: int = 1,
):
    """Megatron ``TransformerConfig`` equivalent to a HF Llama, Qwen2, Qwen3 or Qwen3-MoE config.

    Maps GQA (num_query_groups = num_key_value_heads), SwiGLU (gated_linear_unit + silu), RMSNorm
    (eps = rms_norm_eps), biases (Qwen2: ``add_qkv_bias=True``; no other linear has a bias),
    Qwen3's per-head q/k RMSNorm (``qk_layernorm=True``, same eps), kv_channels = head_dim (Qwen3
    sets it apart from hidden / heads), Qwen3-MoE's sparse MLP in every layer (router and experts:
    :func:`nemo_sspo.megatron.moe.moe_config_kwargs`), dropout 0; CPU shims add their overrides (fp32 pipeline p2p, no fused
    kernels) when no GPU is present. The rotary base is not a TransformerConfig field:
    ``build_policy_model`` passes it to ``GPTModel``.

    Args:
        hf_config: a Llama / Qwen2 Hugging Face config.
        tp_size: tensor-parallel size (must divide the head counts).
        pp_size: pipeline-parallel size (must divide the layer count).
        precision: ``"fp32"`` or ``"bf16"`` (``params_dtype``, ``pipeline_dtype`` and the ``bf16``
            flag; config key ``model.precision``).
        fp8: None (off), ``"e4m3"`` or ``"hybrid"`` (e4m3 forward, e5m2 gradients): Megatron's
            ``fp8`` field, used by TransformerEngine layers only (config key ``model.fp8``).
        fp8_recipe: Megatron's ``fp8_recipe``: ``"delayed"``, ``"tensorwise"``, ``"mxfp8"``
            (Blackwell only) or ``"blockwise"`` (config key ``model.fp8_recipe``).
        ep_size: expert-model-parallel size (config key ``parallel.expert_model_parallel_size``);
            must be 1 for dense models and divide ``num_experts`` for Qwen3-MoE.
        recompute: activation recomputation (:func:`recompute_kwargs`; key ``parallel.recompute``).
        recompute_method: ``"uniform"`` or ``"block"`` (``recompute="full"`` only).
        recompute_num_layers: layers per recomputed chunk / recomputed layers per stage (``full`` only).
        sequence_parallel: Megatron's sequence parallelism (config key ``parallel.sequence_parallel``;
            :mod:`nemo_sspo.megatron.sequence_parallel`); needs ``tp_size > 1``.
        cp_size: context-parallel size (``parallel.context_parallel_size``): Megatron's
            ``context_parallel_size`` (the RoPE table and TransformerEngine's attention split
            each sequence over that many ranks).

    Raises:
        ValueError: naming the field, when num_attention_heads or num_key_value_heads is not
            divisible by tp_size, num_hidden_layers not divisible by pp_size, the config uses an
            unsupported architecture, Llama biases, a non-silu activation, sliding-window attention
            or scaled RoPE; MoE layouts refused by :func:`nemo_sspo.megatron.moe.validate_moe`; or
            naming the ``model.*`` key of a bad precision setting; ``sequence_parallel`` with
            ``tp_size == 1``.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    if sequence_parallel and tp_size == 1:
        raise ValueError("sequence_parallel=True needs tp_size > 1 (sequence parallelism splits the sequence "
                         "over the tensor-parallel ranks): set sequence_parallel=False or raise tp_size")
    dtype = check_model_options(precision=precision, fp8=fp8, fp8_recipe=fp8_recipe)
    check_architecture(hf_config, tp_size, pp_size, ep_size=ep_size)
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
        add_qkv_bias=has_qkv_bias(hf_config),
        qk_layernorm=has_qk_norm(hf_config),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        context_parallel_size=cp_size,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp8=fp8,
        fp8_recipe=fp8_recipe,
        sequence_parallel=sequence_parallel,
    )
    kwargs.update(moe_config_kwargs(hf_config, ep_size))
    kwargs.update(recompute_kwargs(recompute, recompute_method, recompute_num_layers,
                                   layers_per_stage=hf_config.num_hidden_layers // pp_size))
    kwargs.update(cpu_config_overrides())
    return TransformerConfig(**kwargs)


def recompute_kwargs(recompute: str, method: str, num_layers: int, *, layers_per_stage: int) -> dict:
    """``TransformerConfig`` fields for activation recomputation (megatron-core's own mechanism).

    - ``none``: every layer keeps what autograd saves for its backward.
    - ``selective``: ``recompute_granularity="selective"`` with ``recompute_modules=["core_attn"]``: the
      core attention (``softmax(Q K^T / sqrt(d)) V``, whose ``[b, heads, s, s]`` scores and
      probabilities are the ``5 a s / h`` term of Korthikanti et al. 2022, arXiv 2205.05198, sec. 4)
      is recomputed in backward from its saved Q, K, V; the rest is kept.
    - ``full``: ``recompute_granularity="full"``: a recomputed layer keeps only its input ``[s, b, h]``
      and runs its forward again in backward. ``uniform`` recomputes every layer of the stage in
      chunks of ``num_layers`` (the input of each chunk kept); ``block`` recomputes the first
      ``num_layers`` layers of each stage and keeps the others' activations.

    Args:
        recompute: ``"none"``, ``"selective"`` or ``"full"`` (key ``parallel.recompute``).
        method: ``"uniform"`` or ``"block"`` (key ``parallel.recompute_method``; ``full`` only).
        num_layers: key ``parallel.recompute_num_layers`` (``full`` only).
        layers_per_stage: the model's layers per pipeline stage (bounds ``num_layers``).

    Raises:
        ValueError: an unknown name, or ``num_layers`` outside ``[1, layers_per_stage]`` for ``full``.
    """
    if recompute not in tuple(Recompute):
        raise ValueError(f"recompute={recompute!r} is unknown; valid: {', '.join(Recompute)}")
    if recompute == "none":
        return {}
    if recompute == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    if method not in tuple(RecomputeMethod):
        raise ValueError(f"recompute_method={method!r} is unknown; valid: {', '.join(RecomputeMethod)}")
    if num_layers < 1:
        raise ValueError(f"recompute_num_layers={num_layers} must be >= 1 (layers per recomputed chunk or stage)")
    if num_layers > layers_per_stage:
        raise ValueError(f"recompute_num_layers={num_layers} must be at most the model's layers per pipeline "
                         f"stage, {layers_per_stage}")
    return dict(recompute_granularity="full", recompute_method=method, recompute_num_layers=num_layers)


def _transformer_engine_installed() -> bool:
    # find_spec only: importing a broken/empty transformer-engine would fail here, not later.
    return importlib.util.find_spec("transformer_engine") is not None


def resolve_transformer_impl(transformer_impl: str = "auto", fp8: str | None = None) -> str:
    """The layer implementation to build: ``"transformer_engine"`` or ``"local"``.

    ``"auto"`` picks TransformerEngine when a CUDA device is present and the package
    ``transformer-engine`` is installed, the local (pure Megatron-Core) spec otherwise. FP8 needs
    TransformerEngine layers, so ``fp8`` set with ``"auto"`` never falls back to the local spec.

    ``transformer_impl`` must be a :class:`TransformerImpl` (:func:`check_model_options`).

    Raises:
        ValueError: naming ``model.transformer_impl`` / ``model.fp8`` and the fix, when TransformerEngine is requested (or needed for FP8) but no CUDA device or
            no ``transformer-engine`` package is present, or FP8 is combined with the local spec.
    """
    wants_te = transformer_impl == "transformer_engine" or (transformer_impl == "auto" and fp8)
    key = "model.transformer_impl='transformer_engine'" if transformer_impl != "auto" else f"model.fp8={fp8!r}"
    if transformer_impl == "local":
        if fp8 is not None:
            raise ValueError(
                f"model.fp8={fp8!r} needs TransformerEngine layers, but model.transformer_impl='local'; "
                "set model.transformer_impl=auto (or transformer_engine) or model.fp8=null"
            )
        return "local"
    if not torch.cuda.is_available():
        if wants_te:
            raise ValueError(
                f"{key} needs a CUDA device (TransformerEngine is GPU-only) and none is visible; "
                "on CPU set model.transformer_impl=auto (or local) and model.fp8=null"
            )
        return "local"
    if not _transformer_engine_installed():
        if wants_te:
            raise ValueError(
                f"{key} needs the package transformer-engine (import name transformer_engine), which "
                "is not installed: use an NGC PyTorch container (it ships TransformerEngine) or "
                "install transformer-engine[pytorch]; or set model.transformer_impl=local and "
                "model.fp8=null"
            )
        warnings.warn(
            "model.transformer_impl=auto: CUDA is present but transformer-engine is not installed; "
            "building the local (pure Megatron-Core) layer spec",
            stacklevel=2,
        )
        return "local"
    return "transformer_engine"


def _layer_spec(config, impl: str, lora: LoraSettings | None = None):
    """Local (pure Megatron) spec, or the TransformerEngine layer spec (imported lazily); with
    ``lora``, the local spec's targeted linear layers carry adapters (:mod:`nemo_sspo.megatron.lora`).

    The local spec's norms (each layer's two, Qwen3's q/k norms and the final norm) are
    :class:`~nemo_sspo.megatron.sequence_parallel.SequenceParallelTorchNorm` (the torch norms
    megatron-core builds, which also run under sequence parallelism), so it is returned as a
    block spec: ``TransformerBlockSubmodules`` with this stage's layer count.
    """
    from megatron.core.models.gpt import gpt_layer_specs

    # num_experts=None builds the dense MLP; with experts, SequentialMLP (one MLP per local expert).
    if impl == "local":
        from megatron.core.transformer.identity_op import IdentityOp
        from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                                 get_num_layers_to_build)

        layer = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=config.num_moe_experts,
                                                         normalization=config.normalization,
                                                         qk_layernorm=config.qk_layernorm)
        layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
        attention = layer.submodules.self_attention.submodules
        if attention.q_layernorm is not IdentityOp:
            attention.q_layernorm = attention.k_layernorm = SequenceParallelTorchNorm
        if lora is not None:
            with_adapters(layer.submodules, lora)
        return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config),
                                          layer_norm=SequenceParallelTorchNorm)
    if lora is not None:
        raise ValueError("lora: adapters are built on the local layer spec only so far, and this build resolved "
                         "to TransformerEngine; set transformer_impl=local and fp8=null to train adapters")
    return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(num_experts=config.num_moe_experts,
                                                                      qk_layernorm=config.qk_layernorm)


def build_policy_model(
    hf_config: Any,
    *,
    precision: str = "fp32",
    fp8: str | None = None,
    fp8_recipe: str = "delayed",
    transformer_impl: str = "auto",
    recompute: str = "none",
    recompute_method: str = "uniform",
    recompute_num_layers: int = 1,
    sequence_parallel: bool = False,
    lora: LoraSettings | None = None,
):
    """This rank's ``GPTModel`` stage for ``hf_config`` under the current parallel state.

    pre_process / post_process follow this rank's pipeline stage; embeddings and output layer are
    tied iff ``hf_config.tie_word_embeddings``; RoPE with base ``rope_theta``; vocabulary padded to
    a multiple of 128 * tp_size; ``max_sequence_length = max_position_embeddings``. Callers choose
    train/eval mode. Weights are random until
    ``hf_mapping.load_hf_into_megatron``. The true vocabulary size is kept on the model as
    ``model.true_vocab_size`` for ``vocab_shard``, the layer implementation as
    ``model.transformer_impl``. On a CUDA host the whole stage is on the current CUDA device.

    Args:
        hf_config: a Llama / Qwen2 Hugging Face config.
        precision: as :func:`transformer_config_from_hf` (key ``model.precision``). A BF16 model
            still needs Megatron's ``Float16Module`` / mixed-precision optimizer around it for training.
        fp8: as :func:`transformer_config_from_hf` (key ``model.fp8``).
        fp8_recipe: as :func:`transformer_config_from_hf` (key ``model.fp8_recipe``).
        transformer_impl: ``"auto"``, ``"local"`` or ``"transformer_engine"``; see
            :func:`resolve_transformer_impl` (key ``model.transformer_impl``).
        recompute: as :func:`transformer_config_from_hf` (key ``parallel.recompute``).
        recompute_method: as :func:`transformer_config_from_hf` (key ``parallel.recompute_method``).
        recompute_num_layers: as :func:`transformer_config_from_hf` (key ``parallel.recompute_num_layers``).
        sequence_parallel: as :func:`transformer_config_from_hf` (key ``parallel.sequence_parallel``).
        lora: adapters on the targeted linear layers (``model.lora``; :mod:`nemo_sspo.megatron.lora`),
            drawn by :func:`~nemo_sspo.megatron.lora.initialize_adapters`; every other weight is
            frozen. None: no adapters, everything trains.

    Raises:
        ValueError: as ``transformer_config_from_hf`` and ``resolve_transformer_impl``, or if
            parallel state is not initialised; ``lora`` with the TransformerEngine spec.
    """
    from megatron.core.models.gpt import GPTModel

    groups = get_parallel_groups()
    config = transformer_config_from_hf(
        hf_config, tp_size=groups.tp_size, pp_size=groups.pp_size, precision=precision, fp8=fp8,
        fp8_recipe=fp8_recipe, ep_size=groups.ep_size, recompute=recompute, recompute_method=recompute_method,
        recompute_num_layers=recompute_num_layers, sequence_parallel=sequence_parallel, cp_size=groups.cp_size,
    )
    check_model_options(precision=precision, fp8=fp8, fp8_recipe=fp8_recipe, transformer_impl=transformer_impl)
    impl = resolve_transformer_impl(transformer_impl, fp8)
    # Tied embeddings across pipeline stages move the weight with .cuda() for an all-reduce.
    with cpu_device_context():
        model = GPTModel(
            config=config,
            transformer_layer_spec=_layer_spec(config, impl, lora),
            vocab_size=padded_vocab_size(hf_config.vocab_size, groups.tp_size),
            max_sequence_length=hf_config.max_position_embeddings,
            pre_process=groups.is_first_stage,
            post_process=groups.is_last_stage,
            parallel_output=True,
            share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
            position_embedding_type="rope",
            rotary_base=_rope_theta(hf_config),
        )
    even_token_dispatch(model)  # MoE: ranks of a TP x EP group may hold different token counts
    if torch.cuda.is_available():
        # As Megatron-LM's get_model: modules built outside Megatron's init helpers (the local
        # spec's torch norms) start on the CPU even when the linear layers were built on the GPU.
        model.cuda(torch.cuda.current_device())
    model.true_vocab_size = int(hf_config.vocab_size)
    model.transformer_impl = impl
    if lora is not None:
        model.requires_grad_(False)
        for parameter in adapter_parameters(model).values():
            parameter.requires_grad_(True)
        initialize_adapters(model, lora.seed, groups.tp_rank, groups.tp_size, groups.ep_rank)
    return model


_META_SHAPES: dict[tuple, list] = {}
"""Parameter (name, shape, TP-sharded) lists of meta-device builds, by (config class, config JSON,
precision): a 30B MoE build takes about 10 s, and a layout sweep or ``--print-config`` asks again."""


def _meta_parameter_shapes(hf_config: Any, precision: str) -> list:
    """``[(name, shape, tensor_model_parallel)]`` of the whole model (TP = PP = EP = 1) on the meta device."""
    key = (type(hf_config).__name__, hf_config.to_json_string(), precision)
    if key not in _META_SHAPES:
        initialize_parallel(tp_size=1, pp_size=1, seed=0)
        try:
            with torch.device("meta"):
                gpt = build_policy_model(hf_config, precision=precision, transformer_impl="local")
            _META_SHAPES[key] = [(name, param.shape, bool(getattr(param, "tensor_model_parallel", False)))
                                 for name, param in gpt.named_parameters()]
        finally:
            destroy_parallel()
    return _META_SHAPES[key]


def parameter_counts(hf_config: Any, *, tp_size: int, pp_size: int, ep_size: int = 1,
                     precision: str = "bf16") -> list[list[int]]:
    """Parameters each rank holds under TP x PP (x EP), from the model built on the meta device (no memory).

    Builds the whole ``GPTModel`` (TP = PP = 1) under ``torch.device("meta")`` and splits it as
    Megatron does: parameters marked ``tensor_model_parallel`` are divided by ``tp_size`` (the
    vocabulary rows first padded to a multiple of 128 * tp_size, see :func:`padded_vocab_size`),
    the others replicated; decoder layers go to the stages in equal contiguous blocks; the
    embeddings sit on the first stage, the final norm and output layer on the last one, and with
    tied embeddings and ``pp_size > 1`` the last stage holds its own copy of the embedding as the
    output layer. Mixture-of-experts layers: each EP rank holds ``E / ep_size`` of every layer's
    experts, each expert split over TP as the dense MLP (expert tensor parallel size = TP); the
    routers are replicated; attention and norms count as in a dense layer. (This split is ours;
    ``tests/distributed/test_qwen_parallel_mapping.py`` and ``test_moe_parallel_mapping.py`` check
    it against the parameters of real TP2, PP2, EP2 and EP2 x TP2 builds.)

    Args:
        hf_config: a HF config :func:`transformer_config_from_hf` accepts.
        tp_size: tensor-parallel size of the layout (``parallel.tensor_model_parallel_size``).
        pp_size: pipeline-parallel size of the layout (``parallel.pipeline_model_parallel_size``).
        ep_size: expert-parallel size (``parallel.expert_model_parallel_size``; 1 for dense models).
        precision: as :func:`build_policy_model` (does not change the counts).

    Returns:
        ``counts[pp_rank][tp_rank]``: number of parameters (elements) on that rank; every EP rank
        of that (pp, tp) position holds as many (another block of experts).

    Raises:
        ValueError: as :func:`transformer_config_from_hf` for this layout (``ep_size`` not dividing
            the experts, or above 1 for a dense model), or Megatron's parallel state already
            initialised (the count builds its own TP = PP = EP = 1 model).
    """
    transformer_config_from_hf(hf_config, tp_size=tp_size, pp_size=pp_size, precision=precision, ep_size=ep_size)
    shapes = _meta_parameter_shapes(hf_config, precision)
    vocab_rows = padded_vocab_size(hf_config.vocab_size, tp_size) // tp_size
    per_stage = hf_config.num_hidden_layers // pp_size
    counts = [[0] * tp_size for _ in range(pp_size)]
    for name, shape, sharded in shapes:
        if name.startswith(("embedding.", "output_layer.")):
            numel = vocab_rows * shape[1]  # vocab-parallel: each rank's padded vocab shard
        else:
            numel = shape.numel() // tp_size if sharded else shape.numel()
        if ".mlp.experts." in name:
            numel //= ep_size  # summed over the E experts, E / ep_size of them per rank
        if name.startswith("decoder.layers."):
            stages = [int(name.split(".")[2]) // per_stage]
        elif name.startswith("embedding."):
            tied_copy = hf_config.tie_word_embeddings and pp_size > 1
            stages = [0, pp_size - 1] if tied_copy else [0]
        else:  # final norm, untied output layer
            stages = [pp_size - 1]
        for stage in stages:
            for rank in range(tp_size):
                counts[stage][rank] += numel
    return counts


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside DDP / Float16Module wrappers (which expose it as ``.module``)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def uses_transformer_engine(model: torch.nn.Module) -> bool:
    """True when ``model``'s layers come from the TransformerEngine spec, False for the local spec.

    The one place that tells the specs apart: ``build_policy_model`` records the resolved
    implementation on the ``GPTModel`` as ``transformer_impl`` (Megatron-Core 0.16.1's
    ``TransformerConfig`` has no field for it).

    Raises:
        ValueError: if ``model`` was not built by ``build_policy_model``.
    """
    impl = getattr(unwrap_model(model), "transformer_impl", None)
    if impl not in ("local", "transformer_engine"):
        raise ValueError("model has no transformer_impl: build it with build_policy_model()")
    return impl == "transformer_engine"


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


def _check_inputs(input_ids, position_ids, attention_mask, sequence_lengths, cp: tuple[int, int] = (1, 0)) -> None:
    if input_ids.dim() != 2 or position_ids.shape != input_ids.shape:
        raise ValueError(
            f"input_ids and position_ids must both be [B, S], got {tuple(input_ids.shape)} and "
            f"{tuple(position_ids.shape)}"
        )
    # Megatron's RoPE uses positions 0..S-1 (or, packed, the positions forward_logits gives it)
    # and ignores position_ids, so anything else would be silently wrong (e.g. left padding).
    # Under context parallelism (cp = (size, rank)) a row holds this rank's zigzag positions.
    if sequence_lengths is None:
        size, rank = cp
        expected = (torch.arange(input_ids.shape[1]) if size == 1 else
                    zigzag_positions(input_ids.shape[1] * size, size, rank))
        expected = expected.to(position_ids.device).expand_as(position_ids)
        if not torch.equal(position_ids, expected):
            raise ValueError("position_ids must be arange(S) in every row: use right padding")
    else:
        _check_packed(input_ids, sequence_lengths)
        expected = packed_positions(sequence_lengths.to(position_ids.device))[None, :]
        if not torch.equal(position_ids, expected):
            raise ValueError("position_ids of a packed row must restart at 0 at every sequence "
                             "(nemo_sspo.algorithms.micro_batches.packed_positions(sequence_lengths)), "
                             f"got {position_ids[0, :8].tolist()}... for lengths "
                             f"{sequence_lengths[:4].tolist()}...")
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
    sequence_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run this pipeline stage of ``model`` on one micro-batch.

    Args:
        model: GPTModel (optionally wrapped) from ``build_policy_model``.
        input_ids: [B, S] int64 token ids (read on the first stage only).
        position_ids: [B, S] int64, must equal arange(S) per row (right padding); for a packed row,
            positions restarting at 0 at every sequence
            (:func:`nemo_sspo.algorithms.micro_batches.packed_positions`).
        attention_mask: optional [B, S] bool/int, 1 = real token, right padding only. Attention is
            causal, so padding only affects positions after a row's valid tokens; the mask is
            validated, not needed to compute the valid positions' logits.
        sequence_lengths: [K] int64 lengths (each >= 1) of the sequences packed end to end in a
            single row (``B = 1``, summing to S), or None. Attention is then confined to each
            sequence and each sequence's rotary positions restart at 0, so its outputs are those
            of the sequence run alone. TransformerEngine spec: Megatron's THD layout (``GPTModel``
            gets ``packed_seq_params``, no attention mask; the row is padded at its end to
            :func:`~nemo_sspo.megatron.packed_seq.thd_alignment`, e.g. 16 tokens under FP8, and
            the padding dropped again from the last stage's output). Local spec (CPU only): a
            block-diagonal causal mask, and the rotary table read at ``position_ids`` (each
            sequence's own positions; running row positions are exact only in real arithmetic:
            the fp32 angle error grows with the offset, docs/pitfalls.md#packed-positions-cpu).

    Sequence parallelism (``parallel.sequence_parallel``): the row is right-padded with token 0 to
    a multiple of TP (:func:`~nemo_sspo.megatron.sequence_parallel.sequence_parallel_size`; a
    packed row's padding joins its last sequence), so each TP rank holds ``S' / tp`` positions of
    the activations between the tensor-parallel regions. Attention is causal, so no real position
    sees the padding, and the last stage's output is cut back to ``S``.

    Returns:
        Last stage: logits [B, S, V_local] (GPTModel already transposes its sequence-first
        [S, B, V_local] to batch-first when no labels are given), float, V_local = V_padded / tp.
        Other stages: the stage's hidden states [S', B, H] (sequence-first; [S' / tp, B, H] on
        each TP rank under sequence parallelism), for the pipeline schedule to send on; S' = S
        except for a row padded for sequence parallelism or the THD layout.

    Raises:
        ValueError: on bad shapes, non-arange position_ids or left padding; packed sequences that
            do not fill one row, or with an empty sequence, or positions that do not restart; packing with the local spec on a CUDA
            device (names ``parallel.pack_sequences`` and ``model.transformer_impl``) or with
            context parallelism.
    """
    _check_inputs(input_ids, position_ids, attention_mask, sequence_lengths, cp=_cp_layout(model))
    output = _stage_forward(model, input_ids, position_ids, sequence_lengths)
    # The last stage's output is batch-first (logits, or the critic's values): cut the padding.
    return output[:, : input_ids.shape[1]] if get_parallel_groups().is_last_stage else output


def _stage_forward(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                   sequence_lengths: torch.Tensor | None) -> torch.Tensor:
    """This stage's raw output for checked inputs: the row padded for sequence parallelism or the
    THD layout, nothing cut (:func:`forward_logits`).
    """
    if sequence_lengths is not None and uses_transformer_engine(model):
        return _forward_thd(model, input_ids, sequence_lengths)
    width = input_ids.shape[1]
    total = padded_width(width, sequence_parallel_size(unwrap_model(model).config))
    if total > width:  # token 0 as filler: causal attention keeps it out of every real position
        input_ids = F.pad(input_ids, (0, total - width))
        if sequence_lengths is None:
            position_ids = torch.arange(total, device=input_ids.device).expand(input_ids.shape[0], total)
        else:
            sequence_lengths = torch.cat([sequence_lengths[:-1], sequence_lengths[-1:] + total - width])
            position_ids = packed_positions(sequence_lengths.to(input_ids.device))[None, :]
    if sequence_lengths is None:
        return model(input_ids, position_ids, attention_mask_for(total, input_ids.device))
    # The local spec confines attention only through this explicit mask (its DotProductAttention
    # asserts packed_seq_params is None); on CUDA the shim returns None and Megatron would build
    # a plain causal mask, letting sequences attend to each other.
    mask = attention_mask_for(input_ids.shape[1], input_ids.device, sequence_lengths)
    if mask is None:
        raise ValueError("parallel.pack_sequences=true on a CUDA device needs the TransformerEngine "
                         "layer spec (Megatron's THD layout); this model uses the local spec. Set "
                         "model.transformer_impl=transformer_engine (or auto, with transformer-engine "
                         "installed), or parallel.pack_sequences=false")
    with _rotary_at(model, position_ids[0]):
        return model(input_ids, position_ids, mask)


def _cp_layout(model: torch.nn.Module) -> tuple[int, int]:
    """(size, rank) of this rank's context-parallel group for ``model`` ((1, 0) without CP)."""
    size = getattr(getattr(unwrap_model(model), "config", None), "context_parallel_size", 1)
    if size == 1:
        return 1, 0
    from megatron.core import parallel_state

    return size, parallel_state.get_context_parallel_rank()


@contextmanager
def _rotary_at(model: torch.nn.Module, positions: torch.Tensor):
    """Inside, the model's rotary table ``[S, 1, 1, dim]`` is read at ``positions`` ``[S]``.

    Without it the table's rows ``0..S-1`` are used.

    Megatron-Core 0.16.1's ``GPTModel`` builds the table for positions ``0..S-1`` and never reads
    ``position_ids`` under RoPE (the THD path restarts the table itself at each ``cu_seqlens``).
    A forward hook on its ``RotaryEmbedding`` (whose ``lru_cache``-d result it must not change)
    returns the table's rows at ``positions``, on every pipeline stage alike.
    """
    handle = unwrap_model(model).rotary_pos_emb.register_forward_hook(
        lambda module, args, table: table[positions.to(table.device)])
    try:
        yield
    finally:
        handle.remove()


def _forward_thd(model: torch.nn.Module, input_ids: torch.Tensor,
                 sequence_lengths: torch.Tensor) -> torch.Tensor:
    """A packed row [1, S] through the TransformerEngine spec in the THD layout (module
    :mod:`nemo_sspo.megatron.packed_seq`), padded to its alignment; nothing is cut here.
    """
    gpt = unwrap_model(model)
    width = input_ids.shape[1]
    total = padded_width(width, thd_alignment(gpt.config))
    params = packed_seq_params(sequence_lengths, input_ids.device, total_length=total)
    if total > width:  # token 0 as filler: causal attention keeps it out of every real position
        input_ids = F.pad(input_ids, (0, total - width))
    positions = torch.arange(total, device=input_ids.device)[None, :]
    # Last stage with its output layer: batch-first logits [1, total, V_local] (forward_logits
    # trims). Otherwise sequence-first hidden states [total, 1, H] ([total / tp, 1, H] under
    # sequence parallelism): the next stage's input, or forward_hidden's to gather and trim.
    return model(input_ids, positions, None, packed_seq_params=params)


def _check_packed(input_ids: torch.Tensor, sequence_lengths: torch.Tensor) -> None:
    if input_ids.shape[0] != 1 or int(sequence_lengths.sum()) != input_ids.shape[1]:
        raise ValueError(f"packed sequences must fill one row: input_ids {tuple(input_ids.shape)}, "
                         f"sequence lengths summing to {int(sequence_lengths.sum())}")
    if int(sequence_lengths.min()) < 1:
        raise ValueError(f"packed sequences must each hold at least one token, got lengths "
                         f"{sequence_lengths.tolist()}")


def forward_hidden(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    sequence_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Like :func:`forward_logits`, but the last stage returns its final hidden states.

    For the fused output layer (``nemo_sspo.parallel.fused_linear_logprobs_entropy``): the loss
    computes logits only where it reads them. Megatron's ``GPTModel.forward`` returns the decoder
    output (after the final norm) when its ``post_process`` is False; the flag is lowered for this
    call only, so the output layer is skipped and nothing else changes.

    Sequence parallelism: the decoder's output is this TP rank's ``[S' / tp, B, H]``; it is
    all-gathered over TP (:func:`~nemo_sspo.megatron.sequence_parallel.gather_sequence`, as
    Megatron's output layer gathers its input; backward: this rank's rows of the gradient, which
    the fused output layer has already all-reduced over TP) before the padding is cut.

    Returns:
        Last stage: hidden states [B, S, H] (batch-first, the model's output dtype, identical on
        every TP rank; padding for sequence parallelism or the THD layout cut off). Other stages:
        their hidden states [S', B, H] for the pipeline schedule (as :func:`forward_logits`).

    Raises:
        ValueError: bad inputs (as :func:`forward_logits`).
    """
    gpt = unwrap_model(model)
    if not gpt.post_process:
        return forward_logits(model, input_ids, position_ids, sequence_lengths=sequence_lengths)
    _check_inputs(input_ids, position_ids, None, sequence_lengths)
    gpt.post_process = False
    try:
        hidden = _stage_forward(model, input_ids, position_ids, sequence_lengths)
    finally:
        gpt.post_process = True
    return gather_sequence(hidden, gpt.config).transpose(0, 1)[:, : input_ids.shape[1]]


def output_weight(model: torch.nn.Module) -> torch.Tensor:
    """This rank's vocab shard of the output weight ``[V_local, H]`` on the last stage: the word
    embedding when input and output embeddings are tied (its copy on the last stage under PP),
    the output layer's own weight otherwise.
    """
    gpt = unwrap_model(model)
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight
