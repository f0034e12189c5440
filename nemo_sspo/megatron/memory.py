"""Bytes of one Megatron rank, by arithmetic over the model's config: weights, gradients, optimizer
states and the activations a forward saves for its backward. No model is built, nothing is allocated.

Parameters per rank (:func:`rank_parameters`): the tensors ``GPTModel`` holds under TP x PP (x EP),
listed from the HF config (the split of :func:`nemo_sspo.megatron.model.parameter_counts`:
column/row-parallel matrices and the padded vocabulary divided by TP, norms and routers replicated,
experts divided by EP, layers in equal contiguous blocks per stage).

Weights, gradients and optimizer states (:func:`model_state_bytes`), as megatron-core 0.16.1
allocates them (read in ``distributed/param_and_grad_buffer.py``, ``optimizer/optimizer.py``,
``optimizer/distrib_optimizer.py``; checked byte for byte against built objects in
``tests/unit/trainer/test_memory_plan.py`` and ``tests/distributed/test_memory_plan_parallel.py``):

* gradients: DDP's contiguous buffer of ``main_grad`` in fp32 (``grad_reduce_in_fp32=True``), one
  buffer for the dense parameters and one for the experts, ``4 N`` bytes. With the distributed
  optimizer every parameter starts at a multiple of 64 elements and every bucket ends at a multiple
  of ``lcm(DP, 128)``; the shared embedding of a tied model under PP > 1 is a bucket of its own;
  without ``overlap_grad_reduce`` (our DDP) each buffer is one bucket otherwise. The padded size is
  order-independent: ``pad(sum_i pad64(n_i), lcm(DP, 128))`` per bucket.
* weights: the module's parameters, ``N x`` 2 (bf16) or 4 (fp32) bytes; with the distributed
  optimizer they are moved into a parameter buffer of the padded gradient buffer's size.
* optimizer (Adam): the mixed-precision optimizer of a bf16 model keeps fp32 main weights (4 B) and
  ``exp_avg`` / ``exp_avg_sq`` (4 + 4 B) per parameter, 12 N; an fp32 model's optimizer updates
  the parameters themselves, 8 N. With the distributed optimizer each data-parallel rank keeps these
  for its shard of the buffers only: ``12 N / DP`` (dense) and ``12 N_experts / (DP / EP)``
  (experts, sharded over the expert data-parallel group) on average over the ranks (a rank's shard
  holds the parameter elements of its ``1/DP`` of the padded buffer, so ranks differ by at most the
  padding); the fp32 main gradients are ``.float()`` views of the fp32 grad buffer (no copy). With
  ``cpu_offload`` the states live in host memory (``optimizer_offload_fraction=1``): 0 on the GPU.
  Adam's scalar step counters (4 bytes per tensor) are not counted.
* LoRA (``model.lora.rank >= 1``): the base weights are frozen, so they take ``param_bytes`` each and
  nothing else (no gradient buffer, no optimizer state, not in the distributed optimizer's buffers);
  the adapters' factors are the trained parameters above.

Activations (:func:`layer_activation_bytes`, our derivation). The starting point is Korthikanti et
al. 2022 (arXiv 2205.05198, sec. 4.1, eq. 1-2): a GPT layer saves ``s b h (34 + 5 a s / h)`` bytes in
16-bit precision, the ``5 a s / h`` term (attention scores) gone with flash attention or selective
recomputation, everything divided by TP with sequence parallelism, and full recomputation keeping
the layer input ``2 s b h`` only. Our layers differ (GQA with ``g`` key/value heads of size ``d``,
SwiGLU of width ``f``, RMSNorm, dropout 0, so no dropout masks), so we list what they save, with ``e``
the activation element size (4 fp32, 2 bf16), ``t`` TP, ``sp`` = ``t`` with sequence parallelism, else
1, ``T = s b`` tokens:

* local spec (megatron-core's own layers; every term below equals the bytes ``saved_tensors_hooks``
  sees, storages de-duplicated, for the tiny Llama / Qwen2 / Qwen3 / Qwen3-MoE in fp32 and bf16 under
  TP 1 and 2, sequence parallelism, PP 2, EP 2, no / selective / full recomputation, packed and
  padded: ``tests/unit/megatron/test_memory_grid.py`` and ``tests/distributed/test_memory_grid_parallel.py``).
  Bytes, not elements: several tensors are fp32 (4 B) or integer whatever ``e`` is.

  - norms: each of the two RMSNorms computes in fp32 and saves fp32 copies of its input and of its
    normalised input (``2 T h x 4``) and ``rsqrt`` (``T x 4``); the linear after it (``linear_qkv``,
    ``linear_fc1`` or the MoE router) saves its ``e``-byte input: ``2 (4 (2 T h + T) + e T h)``,
    divided by ``t`` with sequence parallelism. (In fp32 the norm's input copy is the residual itself.
    This is torch's CPU ``rms_norm``, which upcasts a 16-bit input; a fused CUDA kernel that keeps the
    16-bit input and ``rsqrt`` only would save less: an over-count, the safe direction.)
  - core attention, unfused: the rotated query, the key (transposed) and the value, both repeated to
    the ``a`` query heads (``3 e T a d / t``), and the softmax: ``attention_softmax_in_fp32`` (True by
    default) keeps its fp32 output (``4 b (a/t) s^2``) and, in 16-bit, also the ``e``-byte copy the
    value product reads (``e b (a/t) s^2``). The output projection saves its input ``e T a d / t``,
    the rotary embedding its cos / sin tables for query and key, ``4 e s d`` per layer.
  - selective recomputation (``recompute_modules=["core_attn"]``) replaces the core attention by its
    checkpointed inputs: the rotated query and key (``e T d (a + g) / t``) and the value, a view that
    keeps the whole fused qkv output alive (``e T d (a + 2 g) / t``).
  - Qwen3's per-head q/k RMSNorms (fp32, as the other norms): the query norm its normalised query and
    ``rsqrt`` per head (``4 (T a d + T a) / t``) and its input, an fp32 copy of the query
    (``4 T a d / t``) except in fp32 with one key/value group per rank (``g = t``: the query is then a
    view of the fused qkv output); the key norm its normalised key and ``rsqrt``
    (``4 (T g d + T g) / t``) and its input: in 16-bit an fp32 copy of the key (``4 T g d / t``), in
    fp32 a view of the fused qkv output (``4 T d (a + 2 g) / t``, already kept by selective
    recomputation's value).
  - dense MLP: the fc1 output ``2 T f / t``, two ``T f / t`` intermediates of the SwiGLU and the fc2
    input ``T f / t``: ``5 e T f / t``.
  - MoE MLP (Qwen3-MoE, the one MoE architecture the mapping covers: ``E`` experts of width ``f_e``,
    top ``k``, allgather dispatcher, no shared expert; expert TP = TP; MoE under TP needs sequence
    parallelism; the term does not depend on EP, and the plan's ``T`` is the largest micro-batch, the
    count :func:`nemo_sspo.megatron.moe.even_token_dispatch` pads every rank's tokens to). The
    router's fp32 top-k probabilities and int64 top-k indices of its ``T / sp`` tokens
    (``12 T k / sp``); the dispatcher gathers the ``T ep`` tokens of the TP x EP group and saves, for
    this rank's ``E / ep`` experts, the bool routing map and fp32 probabilities (``5 T E``), and, per
    token-expert pair routed here (``R``, ``T k`` when routing is balanced): its int64 permutation
    index, its fp32 probability, the permuted token (``e h``) and the expert's fc1 output, two SwiGLU
    intermediates, the probability-weighted product and the fc2 input (``6 e f_e / t``):
    ``12 T k / sp + 5 T E + R (12 + e h + 6 e f_e / t)``.
  - outside the layers: the int64 token ids (first stage, ``8 T``; under TP also the embedding's bool
    mask of the ids outside the rank's vocabulary rows, ``T``), the boolean mask (``s^2``, one per
    forward), the final norm's fp32 copies (last stage, ``4 (2 T h + T) / sp``).

  Layer total: norms + attention + MLP as listed (:func:`layer_activation_bytes`).
* TransformerEngine spec (GPU; flash attention; our reading of the modules, not yet measured on a
  GPU: the plan's output says so): each ``LayerNormLinear`` saves its input and its normalised
  output, ``4 e T h`` for two; the fused attention the rotated query and key ``T d (a + g) / t``, the
  value inside the fused qkv output (whose whole storage stays alive) ``T d (a + 2 g) / t``, its
  output (the projection's input) ``T a d / t`` (all ``e`` bytes) and the softmax statistics
  ``4 b (a/t) s`` bytes (fp32); the MLP ``3 e T f / t`` (fc1 output and SwiGLU output); MoE layers the
  router's fp32 logits and probabilities ``8 T E`` and, for the ``k`` experts of each token, the
  permuted tokens, fc1 output, SwiGLU output and un-permute input: ``e T k (2 h + 3 f_e / t)``. No
  ``s^2`` term; selective recomputation changes nothing measurable. With sequence parallelism the
  ``4 e T h`` part is divided by ``t``; the final norm saves ``e T h``.
* LoRA adapters (:mod:`nemo_sspo.megatron.lora`, local spec): each adapted layer saves its
  low-rank activation ``e T r`` (a row-parallel adapter's ``e T r / t`` under sequence
  parallelism; the experts' fc1 and fc2 adapters ``e R r`` each, over the routed pairs) for its
  ``B``'s gradient; with dropout (``model.lora.dropout > 0``) also the dropped copy of its input, which
  its ``A``'s gradient reads (``e`` an element; measured: no separate mask is kept); its input is the
  base layer's input, already counted (a
  frozen base weight saves no input of its own, so an unadapted layer's input is over-counted: the
  safe direction).
* full recomputation keeps each recomputed chunk's input, ``e T h`` (``/ t`` with SP), per chunk of
  ``recompute_num_layers`` layers (``uniform``), or per recomputed layer (``block``: the first
  ``recompute_num_layers`` layers of a stage; the others keep everything); during the backward one
  chunk's full activations exist again (:attr:`ActivationTerms.recompute_working`).
* context parallelism divides ``s`` (hence ``T``) by CP on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

__all__ = [
    "ActivationTerms",
    "ModelStateBytes",
    "RankParameter",
    "activation_bytes",
    "layer_activation_bytes",
    "model_state_bytes",
    "rank_parameters",
]

_VOCAB_DIVISOR = 128  # Megatron-LM's make_vocab_size_divisible_by (nemo_sspo.megatron.model)


@dataclass(frozen=True)
class RankParameter:
    """One parameter tensor of a rank: ``numel`` elements; ``expert``: in DDP's expert buffer (not
    all-reduced over the whole DP group); ``shared_embedding``: the tied embedding of a PP > 1 model
    (its own bucket under the distributed optimizer); ``frozen``: a base weight under LoRA (no
    gradient, no optimizer state, not in DDP's buffers).
    """

    name: str
    numel: int
    expert: bool = False
    shared_embedding: bool = False
    frozen: bool = False


_COLUMN_TARGETS = ("linear_qkv", "linear_fc1")  # LoRA targets whose base is column-parallel (the rest: row)


def _adapters(prefix: str, target: str, rank: int, in_local: int, out_local: int, whole: int,
              expert: bool = False) -> list[RankParameter]:
    """A LoRA layer's two factors on one rank (nemo_sspo.megatron.lora): column-parallel ``A`` [r, in]
    whole and ``B`` [out / t, r]; row-parallel ``A`` [r, in / t] and ``B`` [out, r] whole. An expert's
    factors sit in DDP's expert buffer like the expert's weights.
    """
    if target in _COLUMN_TARGETS:
        sizes = (rank * whole, out_local * rank)
    else:
        sizes = (rank * in_local, whole * rank)
    return [RankParameter(f"{prefix}.{factor}", numel, expert=expert)
            for factor, numel in zip(("lora_A", "lora_B"), sizes, strict=True)]


def _head_dim(hf: Any) -> int:
    return int(getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)


def _is_moe(hf: Any) -> bool:
    return getattr(hf, "model_type", "") == "qwen3_moe"


def rank_parameters(hf: Any, *, tp: int, pp: int, ep: int = 1, stage: int = 0, lora_rank: int = 0,
                    lora_targets: tuple[str, ...] = ()) -> list[RankParameter]:
    """The parameters of pipeline stage ``stage`` on one rank (any TP rank, any EP rank: all hold
    as many), from the HF config alone (ours; equal to the built model's, tests/unit/trainer/test_memory_plan.py).
    With ``lora_rank >= 1`` every base parameter is frozen and each targeted linear layer of each
    decoder layer (``linear_fc1`` / ``linear_fc2``: of each of this rank's experts in an MoE layer)
    is followed by its adapter's ``lora_A`` and ``lora_B``.

    Args:
        hf: a Llama / Qwen2 / Qwen3 / Qwen3-MoE HF config (fields only).
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        ep: expert-parallel size (1 for dense models).
        stage: the pipeline stage, in ``[0, pp)``.
        lora_rank: the adapters' rank (``model.lora.rank``); 0: no adapters, everything trains.
        lora_targets: the adapted layers (``model.lora.target``: ``linear_qkv``, ``linear_proj``,
            ``linear_fc1``, ``linear_fc2``).

    Returns:
        One :class:`RankParameter` per tensor (element counts, not bytes).

    Raises:
        ValueError: a layout that does not split the model (``tp`` not dividing the heads, ``pp`` the
            layers, ``ep`` the experts) or ``stage`` out of range.
    """
    h, a, g, d = hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, _head_dim(hf)
    layers = hf.num_hidden_layers
    if a % tp or g % tp or layers % pp or not 0 <= stage < pp:
        raise ValueError(f"tp={tp}, pp={pp}, stage={stage} do not split {a} heads / {g} key/value heads / "
                         f"{layers} layers")
    moe = _is_moe(hf)
    if moe and hf.num_experts % ep:
        raise ValueError(f"ep={ep} does not divide num_experts={hf.num_experts}")
    vocab_rows = math.ceil(hf.vocab_size / (_VOCAB_DIVISOR * tp)) * _VOCAB_DIVISOR
    tied = bool(hf.tie_word_embeddings)
    kind = getattr(hf, "model_type", "llama")
    out: list[RankParameter] = []
    if stage == 0:
        out.append(RankParameter("embedding.word_embeddings.weight", vocab_rows * h,
                                 shared_embedding=tied and pp > 1))
    per_stage = layers // pp
    for layer in range(stage * per_stage, (stage + 1) * per_stage):
        p = f"decoder.layers.{layer}."
        qkv = (a + 2 * g) * d // tp
        out += [RankParameter(p + "input_layernorm.weight", h),
                RankParameter(p + "self_attention.linear_qkv.weight", qkv * h)]
        if kind == "qwen2":
            out.append(RankParameter(p + "self_attention.linear_qkv.bias", qkv))
        if kind in ("qwen3", "qwen3_moe"):
            out += [RankParameter(p + "self_attention.q_layernorm.weight", d),
                    RankParameter(p + "self_attention.k_layernorm.weight", d)]
        out += [RankParameter(p + "self_attention.linear_proj.weight", h * a * d // tp),
                RankParameter(p + "pre_mlp_layernorm.weight", h)]
        if moe:
            f = hf.moe_intermediate_size // tp
            out.append(RankParameter(p + "mlp.router.weight", hf.num_experts * h))
            for expert in range(hf.num_experts // ep):
                q = f"{p}mlp.experts.local_experts.{expert}."
                out += [RankParameter(q + "linear_fc1.weight", 2 * f * h, expert=True),
                        RankParameter(q + "linear_fc2.weight", h * f, expert=True)]
        else:
            f = hf.intermediate_size // tp
            out += [RankParameter(p + "mlp.linear_fc1.weight", 2 * f * h),
                    RankParameter(p + "mlp.linear_fc2.weight", h * f)]
        if lora_rank:
            mlps = [f"mlp.experts.local_experts.{i}" for i in range(hf.num_experts // ep)] if moe else ["mlp"]
            shapes = {"linear_qkv": (["self_attention"], h, qkv, h),
                      "linear_proj": (["self_attention"], a * d // tp, h, h),
                      "linear_fc1": (mlps, h, 2 * f, h), "linear_fc2": (mlps, f, h, h)}
            for target in lora_targets:
                owners, in_local, out_local, whole = shapes[target]
                for owner in owners:
                    out += _adapters(f"{p}{owner}.{target}", target, lora_rank, in_local, out_local, whole,
                                     expert=".experts." in owner)
    if stage == pp - 1:
        out.append(RankParameter("decoder.final_layernorm.weight", h))
        if not tied:
            out.append(RankParameter("output_layer.weight", vocab_rows * h))
        elif pp > 1:  # the last stage's own copy of the tied embedding
            out.append(RankParameter("output_layer.weight", vocab_rows * h, shared_embedding=True))
    if lora_rank:
        out = [p if ".lora_" in p.name else replace(p, frozen=True) for p in out]
    return out


def _pad(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _buffer_numel(params: list[RankParameter], dp: int, distributed: bool) -> int:
    """Elements of one DDP buffer (megatron-core 0.16.1 ``_ParamAndGradBuffer`` with bucket_size None)."""
    if not distributed:
        return sum(p.numel for p in params)
    end = math.lcm(dp, 128)
    shared = [p for p in params if p.shared_embedding]
    rest = [p for p in params if not p.shared_embedding]
    total = sum(_pad(_pad(p.numel, 64), end) for p in shared)
    if rest:
        total += _pad(sum(_pad(p.numel, 64) for p in rest), end)
    return total


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes one rank holds for a model's training state (module docstring for the sources).

    ``weights``: parameters (or the distributed optimizer's parameter buffer); ``gradients``: the fp32
    grad buffers; ``optimizer``: main weights and Adam moments on the GPU (0 with ``cpu_offload``);
    ``optimizer_host``: the same states in host memory with ``cpu_offload``; ``numel``: parameters
    (unpadded) of the rank.
    """

    weights: int
    gradients: int
    optimizer: float
    optimizer_host: float
    numel: int


def model_state_bytes(params: list[RankParameter], *, param_bytes: int, dp: int, ep: int = 1,
                      distributed_optimizer: bool = False, cpu_offload: bool = False,
                      trainable: bool = True) -> ModelStateBytes:
    """Weights, gradients and optimizer bytes of one rank holding ``params`` (module docstring).

    Args:
        params: :func:`rank_parameters` of the rank.
        param_bytes: 2 (bf16 model, mixed-precision optimizer with fp32 main weights) or 4 (fp32).
        dp: data-parallel size (the dense buffer's group); the experts' group is ``dp // ep``.
        ep: expert-parallel size.
        distributed_optimizer: megatron's distributed optimizer (padded buffers, sharded states).
        cpu_offload: optimizer states in host memory.
        trainable: False for a frozen model (reference policy): weights only. Parameters marked
            ``frozen`` (LoRA's base) count their weights only either way.

    Returns:
        :class:`ModelStateBytes` (optimizer bytes are a mean over DP ranks under the distributed
        optimizer, hence a float).

    Raises:
        ValueError: ``param_bytes`` not 2 or 4, or ``dp`` not divisible by ``ep``.
    """
    if param_bytes not in (2, 4) or dp % ep:
        raise ValueError(f"param_bytes={param_bytes} must be 2 or 4 and ep={ep} must divide dp={dp}")
    numel = sum(p.numel for p in params)
    if not trainable:
        return ModelStateBytes(param_bytes * numel, 0, 0.0, 0.0, numel)
    trained = [p for p in params if not p.frozen]
    frozen = numel - sum(p.numel for p in trained)
    dense = [p for p in trained if not p.expert]
    experts = [p for p in trained if p.expert]
    groups = [(dense, dp), (experts, dp // ep)]
    buffers = sum(_buffer_numel(group, size, distributed_optimizer) for group, size in groups if group)
    weights = param_bytes * (frozen + (buffers if distributed_optimizer else numel - frozen))
    per_param = 12 if param_bytes == 2 else 8  # fp32 main weights (bf16 models only) + exp_avg + exp_avg_sq
    states = sum(per_param * sum(p.numel for p in group) / (size if distributed_optimizer else 1)
                 for group, size in groups if group)
    return ModelStateBytes(weights=weights, gradients=4 * buffers, optimizer=0.0 if cpu_offload else states,
                           optimizer_host=states if cpu_offload else 0.0, numel=numel)


def _has_qk_norm(hf: Any) -> bool:
    return getattr(hf, "model_type", "") in ("qwen3", "qwen3_moe")


def layer_activation_bytes(hf: Any, *, tokens: int, rows: int, seq: int, tp: int = 1, act_bytes: int = 2,
                           impl: str = "transformer_engine", recompute: str = "none",
                           sequence_parallel: bool = False, routed_tokens: float | None = None,
                           lora_rank: int = 0, lora_targets: tuple[str, ...] = (), lora_dropout: float = 0.0) -> float:
    """Bytes one transformer layer saves for its backward on one micro-batch (module docstring: the
    formula of each spec, term by term; ours).

    Args:
        hf: the HF config (Llama / Qwen2 / Qwen3 / Qwen3-MoE).
        tokens: ``T``, the micro-batch's tokens on this rank (rows x padded width, after CP).
        rows: ``b``, rows of the micro-batch (1 for a packed row).
        seq: ``s``, the padded width of a row (the attention score matrix is ``s x s`` per row).
        tp: tensor-parallel size.
        act_bytes: ``e``, 2 (bf16) or 4 (fp32).
        impl: ``local`` (unfused attention) or ``transformer_engine`` (flash attention).
        recompute: ``none`` or ``selective`` (``full`` is handled by :func:`activation_bytes`).
        sequence_parallel: split the norm-side activations over TP.
        routed_tokens: ``R``, the token-expert pairs this rank's experts process (MoE models, local
            spec; the TransformerEngine formula assumes balanced routing); None:
            balanced routing, ``R = T k`` whatever EP is (the ``T ep`` tokens gathered over EP send
            ``T ep k`` pairs, ``1 / ep`` of them to this rank's experts). Routing is data-dependent: a
            rank whose experts get more than their share saves ``R - T k`` pairs more than planned.

        lora_rank: LoRA's rank (0: no adapters).
        lora_targets: the adapted layers.
        lora_dropout: the adapters' dropout probability (``model.lora.dropout``); above 0 each adapter
            also saves the dropped copy of its input (``e`` bytes an element).

    Returns:
        Bytes (a float: ``a / t`` and ``T / t`` need not be integers in a plan).

    Raises:
        ValueError: an unknown ``impl`` or ``recompute``.
    """
    h, a, g, d, e = hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, _head_dim(hf), act_bytes
    if impl not in ("local", "transformer_engine") or recompute not in ("none", "selective"):
        raise ValueError(f"impl={impl!r} / recompute={recompute!r} unknown")
    t, sp, T = tp, (tp if sequence_parallel else 1), tokens
    moe = _is_moe(hf)
    qkv = T * (a + 2 * g) * d / t  # elements of the fused qkv output
    if impl == "local":
        norms = 2 * (4 * (2 * T * h + T) + e * T * h) / sp
        if recompute == "selective":
            attention = e * T * (a + g) * d / t + e * qkv
        else:
            scores = rows * (a / t) * seq * seq
            attention = 3 * e * T * a * d / t + scores * (4 + (e if e < 4 else 0))
        attention += e * T * a * d / t + 4 * e * seq * d
        if _has_qk_norm(hf):
            attention += 4 * (T * a * d + T * a + T * g * d + T * g) / t
            if e < 4 or g != t:
                attention += 4 * T * a * d / t  # the query norm's input: a copy, except an fp32 view (g == t)
            if e < 4:
                attention += 4 * T * g * d / t  # the key norm's fp32 copy of its input
            elif recompute != "selective":
                attention += 4 * qkv  # fp32: the key norm's input is a view of the whole qkv output
        mlp = 5 * e * T * hf.intermediate_size / t if not moe else None
    else:
        norms = 4 * e * T * h / sp
        attention = e * (T * d * (2 * a + 3 * g) / t + T * a * d / t) + 4 * rows * (a / t) * seq
        mlp = 3 * e * T * hf.intermediate_size / t if not moe else None
    if moe:
        k, experts, f = hf.num_experts_per_tok, hf.num_experts, hf.moe_intermediate_size / t
        if impl == "local":
            routed = T * k if routed_tokens is None else routed_tokens
            mlp = 12 * T * k / sp + 5 * T * experts + routed * (12 + e * h + 6 * e * f)
        else:
            mlp = 8 * T * experts + e * T * k * (2 * h + 3 * f)
    # LoRA: each adapter's low-rank activation [T, r], which its B's gradient reads (all T tokens after a
    # column-parallel adapter's gather, T / sp after a row-parallel adapter's reduce-scatter); its input
    # is the base layer's, counted above. The experts' adapters: [R, r] each for fc1 and fc2 (no
    # communication of their own; R summed over this rank's experts).
    pairs = (T * hf.num_experts_per_tok if routed_tokens is None else routed_tokens) if moe else None
    adapters = sum(e * lora_rank * (pairs if moe and target in ("linear_fc1", "linear_fc2") else
                                    T / (1 if target in _COLUMN_TARGETS else sp)) for target in lora_targets)
    if lora_dropout > 0:  # each adapter's input (a column-parallel layer's before its gather), dropped: one copy
        width = hf.moe_intermediate_size / t if moe else hf.intermediate_size / t
        mlp_rows = pairs if moe else T
        inputs = {"linear_qkv": T * h / sp, "linear_proj": T * a * d / t, "linear_fc1": mlp_rows * h / (1 if moe else sp),
                  "linear_fc2": mlp_rows * width}
        adapters += e * sum(inputs[target] for target in lora_targets)
    return norms + attention + mlp + adapters


@dataclass(frozen=True)
class ActivationTerms:
    """Activation bytes of one pipeline stage on one rank for one micro-batch.

    ``layers``: what the stage's decoder layers save in the forward, with their inputs (token ids on
    the first stage, the local spec's boolean mask ``s^2`` bytes, the rotary table of recomputed
    chunks ``4 s d``); ``final_norm``: the last stage's
    final RMSNorm (input and normalised input); ``recompute_working``: with full recomputation, the
    saved activations of one recomputed chunk, rebuilt during its backward (0 otherwise).
    """

    layers: float
    final_norm: float
    recompute_working: float

    @property
    def saved(self) -> float:
        """Bytes the forward of one micro-batch leaves for the backward (``layers + final_norm``)."""
        return self.layers + self.final_norm


def activation_bytes(hf: Any, *, tokens: int, rows: int, seq: int, tp: int, pp: int, stage: int,
                     act_bytes: int, impl: str, recompute: str = "none", recompute_method: str = "uniform",
                     recompute_num_layers: int = 1, sequence_parallel: bool = False,
                     routed_tokens: float | None = None, lora_rank: int = 0,
                     lora_targets: tuple[str, ...] = (), lora_dropout: float = 0.0) -> ActivationTerms:
    """The activations of ``stage``'s layers for one micro-batch (module docstring; ours).

    Args:
        hf: the HF config.
        tokens: ``T``, the micro-batch's tokens on this rank.
        rows: ``b``, its rows.
        seq: ``s``, its padded row width.
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        stage: this pipeline stage, in ``[0, pp)``.
        act_bytes: ``e``, 2 (bf16) or 4 (fp32).
        impl: ``local`` or ``transformer_engine``.
        recompute: ``parallel.recompute`` (none, selective, full).
        recompute_method: ``parallel.recompute_method`` (uniform, block).
        recompute_num_layers: ``parallel.recompute_num_layers``.
        sequence_parallel: ``parallel.sequence_parallel``.
        routed_tokens: as :func:`layer_activation_bytes` (None: balanced routing), per MoE layer
            (the stage's mean: the bytes are linear in it).
        lora_rank: as :func:`layer_activation_bytes`.
        lora_targets: as :func:`layer_activation_bytes`.
        lora_dropout: as :func:`layer_activation_bytes`.

    Returns:
        :class:`ActivationTerms` in bytes.

    Raises:
        ValueError: as :func:`layer_activation_bytes`, or an unknown ``recompute`` / method.
    """
    per_stage = hf.num_hidden_layers // pp
    sp = tp if sequence_parallel else 1
    layer_input = act_bytes * tokens * hf.hidden_size / sp
    keep = "selective" if recompute == "selective" else "none"
    one = layer_activation_bytes(hf, tokens=tokens, rows=rows, seq=seq, tp=tp, act_bytes=act_bytes, impl=impl,
                                 recompute=keep, sequence_parallel=sequence_parallel,
                                 routed_tokens=routed_tokens, lora_rank=lora_rank, lora_targets=lora_targets,
                                 lora_dropout=lora_dropout)
    if recompute in ("none", "selective"):
        layers, working = per_stage * one, 0.0
    elif recompute == "full" and recompute_method == "uniform":
        chunks = -(-per_stage // recompute_num_layers)
        layers, working = chunks * layer_input, min(recompute_num_layers, per_stage) * one
    elif recompute == "full" and recompute_method == "block":
        recomputed = min(recompute_num_layers, per_stage)
        layers = recomputed * layer_input + (per_stage - recomputed) * one
        working = one if recomputed else 0.0
    else:
        raise ValueError(f"recompute={recompute!r} / recompute_method={recompute_method!r} unknown")
    if stage == pp - 1:
        # local: fp32 copies of the input and normalised input, and rsqrt, whatever the precision
        norm = 4 * (2 * tokens * hf.hidden_size + tokens) if impl == "local" else act_bytes * tokens * hf.hidden_size
        final = norm / sp
    else:
        final = 0.0
    # the embedding's int64 token ids; under TP also its bool mask of the ids outside this rank's rows
    inputs = (8 * tokens + (tokens if tp > 1 else 0)) if stage == 0 else 0
    if impl == "local":
        inputs += seq * seq  # the explicit boolean causal (or block-diagonal) mask, one per forward
    if recompute == "full":
        inputs += 4 * seq * _head_dim(hf)  # the fp32 rotary table, an input of every recomputed chunk
    return ActivationTerms(layers=layers + inputs, final_norm=final, recompute_working=working)
