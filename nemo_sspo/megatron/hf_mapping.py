"""HF Llama / Qwen2 / Qwen3 / Qwen3-MoE <-> Megatron-Core GPTModel weight mapping under tensor,
pipeline and expert parallelism.

Megatron layouts (per decoder layer; H = hidden, d = head_dim, G = num_key_value_heads,
Q = num_attention_heads / G query heads per group, F = intermediate_size):

- ``self_attention.linear_qkv.weight`` [G*(Q+2)*d, H]: per KV group g the rows are
  [q heads of g (Q*d), k_g (d), v_g (d)]; column-parallel, so TP rank r holds groups
  [r*G/tp, (r+1)*G/tp). HF q head h belongs to group h // Q (as ``repeat_kv``).
- ``self_attention.linear_qkv.bias`` [G*(Q+2)*d] (Qwen2 only): HF q/k/v biases in the same grouped
  order and the same TP slicing as the weight rows. Qwen2 has no o_proj or MLP biases.
- ``self_attention.q_layernorm.weight`` / ``k_layernorm.weight`` [d] (Qwen3 only): HF
  ``q_norm`` / ``k_norm``, one RMSNorm over d shared by all heads, so replicated on every TP rank.
- ``self_attention.linear_proj.weight`` [H, heads*d]: row-parallel, sliced on dim 1.
- ``mlp.linear_fc1.weight`` [2F, H]: each TP rank holds [gate shard; up shard] (the gated MLP
  chunks its local output in two), i.e. each half is sliced separately.
- ``mlp.linear_fc2.weight`` [H, F]: row-parallel, sliced on dim 1.
- Qwen3-MoE, per layer: ``mlp.router.weight`` [E, H] (HF ``mlp.gate.weight``, replicated), and per
  local expert i of EP rank r (global expert e = r * E / EP + i, see :mod:`nemo_sspo.megatron.moe`)
  ``mlp.experts.local_experts.{i}.linear_fc1.weight`` / ``linear_fc2.weight`` laid out and TP-sliced
  as the dense ``linear_fc1`` / ``linear_fc2`` with F = ``moe_intermediate_size``. HF names are the
  per-expert ones of checkpoints on disk and of vLLM's ``load_weights``
  (``mlp.experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``), not the fused 3-D
  parameters transformers 5 holds in memory (:func:`nemo_sspo.models.fuse_expert_weights`
  converts).
- RMSNorm weights: ``input_layernorm`` / ``pre_mlp_layernorm`` (local spec), or the norms fused
  into ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight`` (TransformerEngine spec).
- Embedding / output layer: [V_padded, H], sliced on dim 0; padded rows are zero.
- Local layer i on pipeline stage p is global layer ``layer.layer_number - 1``.
- LoRA adapters (:mod:`nemo_sspo.megatron.lora`) have no HF name: a load fills the base weights
  only, an export (refit, HF checkpoint) sends each adapted weight merged, ``W + (alpha / r) B A``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from nemo_sspo.megatron.lora import base_parameters, lora_layers, merged_parameters
from nemo_sspo.megatron.model import has_qk_norm, has_qkv_bias, padded_vocab_size, unwrap_model
from nemo_sspo.megatron.moe import global_expert, is_moe, num_experts
from nemo_sspo.megatron.parallel_setup import ParallelGroups, get_parallel_groups

__all__ = ["export_hf_adapters", "export_hf_state_dict", "expected_hf_keys", "iter_hf_weight_buckets",
           "load_hf_into_megatron"]

_EMBED, _NORM, _LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
_HF_LAYER = {
    "q": "self_attn.q_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k": "self_attn.k_proj.weight",
    "k_bias": "self_attn.k_proj.bias",
    "v": "self_attn.v_proj.weight",
    "v_bias": "self_attn.v_proj.bias",
    "o": "self_attn.o_proj.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
    "experts": "",  # Qwen3-MoE: the per-expert names of _expert_names, then the router
    "router": "mlp.gate.weight",
    "ln1": "input_layernorm.weight",
    "ln2": "post_attention_layernorm.weight",
}
# Megatron parameter names per decoder layer; norms have a local-spec and a TE-spec name.
_MEG_LAYER = {
    "qkv": ("self_attention.linear_qkv.weight",),
    "qkv_bias": ("self_attention.linear_qkv.bias",),
    "proj": ("self_attention.linear_proj.weight",),
    "q_norm": ("self_attention.q_layernorm.weight",),
    "k_norm": ("self_attention.k_layernorm.weight",),
    "fc1": ("mlp.linear_fc1.weight",),
    "fc2": ("mlp.linear_fc2.weight",),
    "router": ("mlp.router.weight",),
    "ln1": ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
    "ln2": ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
}


_BIAS_KEYS = ("q_bias", "k_bias", "v_bias")
_QK_NORM_KEYS = ("q_norm", "k_norm")
_DENSE_MLP_KEYS = ("gate", "up", "down")
_MOE_KEYS = ("experts", "router")
_EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")


def _layer_keys(hf_config: Any) -> list[str]:
    """Short names of one HF decoder layer's parameters, in HF order (q/k/v biases for Qwen2,
    q/k norms for Qwen3 and Qwen3-MoE, experts and router instead of the dense MLP for Qwen3-MoE).
    """
    absent = (() if has_qkv_bias(hf_config) else _BIAS_KEYS) + (
        () if has_qk_norm(hf_config) else _QK_NORM_KEYS) + (
        _DENSE_MLP_KEYS if is_moe(hf_config) else _MOE_KEYS)
    return [key for key in _HF_LAYER if key not in absent]


def _expert_names(expert: int) -> list[str]:
    """HF names of expert ``expert``'s weights within a layer: gate, up, down projections."""
    return [f"mlp.experts.{expert}.{proj}.weight" for proj in _EXPERT_PROJ]


def _layer_names(hf_config: Any) -> list[str]:
    """HF parameter names of one decoder layer (without the ``model.layers.{i}.`` prefix), in order."""
    names = []
    for key in _layer_keys(hf_config):
        if key == "experts":
            names += [name for expert in range(num_experts(hf_config)) for name in _expert_names(expert)]
        else:
            names.append(_HF_LAYER[key])
    return names


def expected_hf_keys(hf_config: Any) -> list[str]:
    """HF parameter names of a Llama, Qwen2, Qwen3 or Qwen3-MoE model, in HF order (``lm_head``
    also when tied, as transformers 5 ``state_dict()`` lists it; Qwen3-MoE experts one by one, as
    checkpoints store them).
    """
    keys = [_EMBED]
    names = _layer_names(hf_config)
    for layer in range(hf_config.num_hidden_layers):
        keys += [f"model.layers.{layer}.{name}" for name in names]
    return keys + [_NORM, _LM_HEAD]


def _check_hf_keys(hf_state_dict: dict[str, torch.Tensor], hf_config: Any) -> None:
    expected = set(expected_hf_keys(hf_config))
    tied = bool(hf_config.tie_word_embeddings)
    optional = {_LM_HEAD} if tied else set()
    missing = sorted(expected - optional - hf_state_dict.keys())
    unexpected = sorted(hf_state_dict.keys() - expected)
    if missing or unexpected:
        raise ValueError(
            f"hf_state_dict does not match hf_config: missing={missing}, unexpected={unexpected}"
        )
    lm_head = hf_state_dict.get(_LM_HEAD)
    if tied and lm_head is not None and not torch.equal(lm_head, hf_state_dict[_EMBED]):
        raise ValueError(
            "tie_word_embeddings=True but hf_state_dict['lm_head.weight'] differs from embed_tokens"
        )


def _resolve(params: dict, prefix: str, candidates: tuple[str, ...]) -> str:
    """The first candidate name present in ``params`` (spec-dependent naming), else the first."""
    for name in candidates:
        if prefix + name in params:
            return prefix + name
    return prefix + candidates[0]


def _shard(tensor: torch.Tensor, dim: int, groups: ParallelGroups) -> torch.Tensor:
    return tensor.chunk(groups.tp_size, dim=dim)[groups.tp_rank]


def _pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    padded = weight.new_zeros(rows, weight.shape[1])
    padded[: weight.shape[0]] = weight
    return padded


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hf_config: Any) -> torch.Tensor:
    """HF q [heads*d, ...], k / v [G*d, ...] -> Megatron's grouped [G*(Q+2)*d, ...].

    ``...`` is ``H`` for the weights and empty for the (Qwen2) biases.
    """
    groups, rest = hf_config.num_key_value_heads, q.shape[1:]
    grouped = [t.reshape(groups, -1, *rest) for t in (q, k, v)]
    return torch.cat(grouped, dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, hf_config: Any) -> tuple[torch.Tensor, ...]:
    """Inverse of ``_fuse_qkv`` on the full (TP-gathered) fused weight or bias."""
    groups, rest = hf_config.num_key_value_heads, qkv.shape[1:]
    head_dim = qkv.shape[0] // (hf_config.num_attention_heads + 2 * groups)
    q_rows = hf_config.num_attention_heads // groups * head_dim
    grouped = qkv.reshape(groups, -1, *rest)
    q, k, v = grouped.split([q_rows, head_dim, head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _mlp_targets(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, fc1: str, fc2: str,
                 groups: ParallelGroups) -> dict:
    """One SwiGLU MLP (dense, or one expert): fc1 = [gate shard; up shard], fc2 sliced on dim 1."""
    return {fc1: torch.cat([_shard(gate, 0, groups), _shard(up, 0, groups)], dim=0),
            fc2: _shard(down, 1, groups)}


def _moe_targets(hf: dict, hf_prefix: str, prefix: str, params: dict, groups: ParallelGroups) -> dict:
    """Router (replicated) and this EP rank's experts of one Qwen3-MoE layer."""
    targets = {_resolve(params, prefix, _MEG_LAYER["router"]): hf[hf_prefix + _HF_LAYER["router"]]}
    local = _local_expert_count(params, prefix)
    for index in range(local):
        names = _expert_names(global_expert(index, groups.ep_rank, local))
        expert = f"{prefix}mlp.experts.local_experts.{index}."
        targets.update(_mlp_targets(*(hf[hf_prefix + name] for name in names), expert + "linear_fc1.weight",
                                    expert + "linear_fc2.weight", groups))
    return targets


def _local_expert_count(params: dict, prefix: str) -> int:
    """Number of ``mlp.experts.local_experts.{i}`` in layer ``prefix`` of this rank's model."""
    start = f"{prefix}mlp.experts.local_experts."
    return len({name[len(start):].split(".")[0] for name in params if name.startswith(start)})


def _layer_targets(hf: dict, hf_layer: int, prefix: str, params: dict, hf_config, groups) -> dict:
    hf_prefix = f"model.layers.{hf_layer}."

    def get(key: str) -> torch.Tensor:
        return hf[hf_prefix + _HF_LAYER[key]]

    qkv = _fuse_qkv(get("q"), get("k"), get("v"), hf_config)
    if is_moe(hf_config):
        targets = _moe_targets(hf, hf_prefix, prefix, params, groups)
    else:
        targets = _mlp_targets(get("gate"), get("up"), get("down"), _resolve(params, prefix, _MEG_LAYER["fc1"]),
                               _resolve(params, prefix, _MEG_LAYER["fc2"]), groups)
    if has_qkv_bias(hf_config):
        qkv_bias = _fuse_qkv(get("q_bias"), get("k_bias"), get("v_bias"), hf_config)
        targets[_resolve(params, prefix, _MEG_LAYER["qkv_bias"])] = _shard(qkv_bias, 0, groups)
    if has_qk_norm(hf_config):
        targets.update({_resolve(params, prefix, _MEG_LAYER[key]): get(key) for key in _QK_NORM_KEYS})
    return targets | {
        _resolve(params, prefix, _MEG_LAYER["qkv"]): _shard(qkv, 0, groups),
        _resolve(params, prefix, _MEG_LAYER["proj"]): _shard(get("o"), 1, groups),
        _resolve(params, prefix, _MEG_LAYER["ln1"]): get("ln1"),
        _resolve(params, prefix, _MEG_LAYER["ln2"]): get("ln2"),
    }


def _megatron_targets(gpt, hf: dict, hf_config: Any, params: dict, groups: ParallelGroups) -> dict:
    """Megatron parameter name -> this rank's tensor (HF values sliced for TP, padded vocab)."""
    rows = padded_vocab_size(hf_config.vocab_size, groups.tp_size)
    targets = {}
    if gpt.pre_process:
        targets["embedding.word_embeddings.weight"] = _shard(_pad_rows(hf[_EMBED], rows), 0, groups)
    for index, layer in enumerate(gpt.decoder.layers):
        prefix = f"decoder.layers.{index}."
        hf_layer = layer.layer_number - 1  # global, 1-based in Megatron: includes the PP offset
        targets.update(_layer_targets(hf, hf_layer, prefix, params, hf_config, groups))
    if gpt.post_process:
        targets["decoder.final_layernorm.weight"] = hf[_NORM]
        if gpt.output_layer.weight is not None:  # None when tied on a single stage
            source = hf[_EMBED] if hf_config.tie_word_embeddings else hf[_LM_HEAD]
            targets["output_layer.weight"] = _shard(_pad_rows(source, rows), 0, groups)
    return targets


def load_hf_into_megatron(
    model: torch.nn.Module, hf_state_dict: dict[str, torch.Tensor], hf_config: Any
) -> None:
    """Copy a full HF Llama / Qwen2 / Qwen3 / Qwen3-MoE state dict into this rank's (TP shard, PP
    stage, EP experts) Megatron model.

    Every rank passes the full HF dict; each copies only its slices (see module docstring), cast
    to the parameter's dtype and device. No communication. Qwen3-MoE experts use the per-expert
    checkpoint names (``model.layers.{l}.mlp.experts.{e}.gate_proj.weight``, ...).

    Raises:
        ValueError: listing missing / unexpected HF keys, Megatron parameters the mapping does not
            cover (or names it produced that the model lacks), or shape mismatches.
    """
    _check_hf_keys(hf_state_dict, hf_config)
    gpt = unwrap_model(model)
    params = base_parameters(gpt)
    targets = _megatron_targets(gpt, hf_state_dict, hf_config, params, get_parallel_groups())
    missing = sorted(params.keys() - targets.keys())
    unexpected = sorted(targets.keys() - params.keys())
    if missing or unexpected:
        raise ValueError(
            f"Megatron parameters not covered: {missing}; "
            f"mapped names absent from model: {unexpected}"
        )
    bad = [
        f"{name}: model {tuple(params[name].shape)} vs mapped {tuple(tensor.shape)}"
        for name, tensor in targets.items()
        if params[name].shape != tensor.shape
    ]
    if bad:
        raise ValueError(f"shape mismatch: {bad}")
    with torch.no_grad():
        for name, tensor in targets.items():
            params[name].copy_(tensor.to(dtype=params[name].dtype, device=params[name].device))


def _gather_tp(tensor: torch.Tensor, dim: int | None, groups: ParallelGroups):
    """All TP shards of ``tensor`` (a list), or concatenated on ``dim`` if ``dim`` is given."""
    shards = [torch.empty_like(tensor) for _ in range(groups.tp_size)]
    dist.all_gather(shards, tensor.detach().contiguous(), group=groups.tp_group)
    if dim is None:
        return shards
    return shards[0] if len(shards) == 1 else torch.cat(shards, dim=dim)


def _gate_up(fc1: torch.Tensor, groups: ParallelGroups) -> tuple[torch.Tensor, torch.Tensor]:
    """Full (gate, up) rows from this rank's fc1 rows ``[gate shard; up shard]`` (TP gather); fc1 is
    the weight, or a LoRA ``B`` split like it.
    """
    halves = [shard.chunk(2, dim=0) for shard in _gather_tp(fc1.detach(), None, groups)]
    return torch.cat([gate for gate, _ in halves], dim=0), torch.cat([up for _, up in halves], dim=0)


def _export_mlp(fc1: torch.Tensor, fc2: torch.Tensor, groups: ParallelGroups) -> tuple[torch.Tensor, ...]:
    """Full (gate, up, down) of one SwiGLU MLP from this rank's fc1 / fc2 shards (TP gathers)."""
    return (*_gate_up(fc1, groups), _gather_tp(fc2.detach(), 1, groups))


def _export_experts(params: dict, prefix: str, hf_config, groups: ParallelGroups) -> dict:
    """All experts of one Qwen3-MoE layer, by per-expert HF name: each EP rank gathers its local
    experts over TP, then one all-gather over the EP group assembles the layer's E experts (only
    this layer's: the streamed export holds one layer's experts at a time).
    """
    local = _local_expert_count(params, prefix)
    mlps = [_export_mlp(params[f"{prefix}mlp.experts.local_experts.{i}.linear_fc1.weight"],
                        params[f"{prefix}mlp.experts.local_experts.{i}.linear_fc2.weight"], groups)
            for i in range(local)]
    stacked = _all_experts(mlps, groups)  # gate, up, down: [E, ...]
    values = {}
    for expert in range(num_experts(hf_config)):
        values.update(zip(_expert_names(expert), (tensor[expert] for tensor in stacked), strict=True))
    return values


def _all_experts(local: list[tuple[torch.Tensor, ...]], groups: ParallelGroups) -> list[torch.Tensor]:
    """The same tensors of every expert of a layer: ``local[i]`` holds this EP rank's local expert
    ``i``'s; each is stacked to ``[E_local, ...]`` and gathered over EP to ``[E, ...]`` (global order).
    """
    stacked = [torch.stack(parts) for parts in zip(*local, strict=True)]
    return [_gather_ep(tensor, groups) for tensor in stacked] if groups.ep_size > 1 else stacked


def _gather_ep(tensor: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """[E_local, ...] on every EP rank -> [E, ...] in EP-rank order (the global expert order)."""
    shards = [torch.empty_like(tensor) for _ in range(groups.ep_size)]
    dist.all_gather(shards, tensor.contiguous(), group=groups.ep_group)
    return torch.cat(shards, dim=0)


def _export_layer(params: dict, prefix: str, hf_prefix: str, hf_config, groups) -> dict:
    def get(key: str) -> torch.Tensor:
        return params[_resolve(params, prefix, _MEG_LAYER[key])].detach()

    q, k, v = _split_qkv(_gather_tp(get("qkv"), 0, groups), hf_config)
    values = {
        "q": q, "k": k, "v": v,
        "o": _gather_tp(get("proj"), 1, groups),
        "ln1": get("ln1").clone(),
        "ln2": get("ln2").clone(),
    }
    if is_moe(hf_config):
        values["router"] = get("router").clone()
        experts = _export_experts(params, prefix, hf_config, groups)
    else:
        values.update(zip(_DENSE_MLP_KEYS, _export_mlp(get("fc1"), get("fc2"), groups), strict=True))
        experts = {}
    if has_qkv_bias(hf_config):
        q_bias, k_bias, v_bias = _split_qkv(_gather_tp(get("qkv_bias"), 0, groups), hf_config)
        values.update(q_bias=q_bias, k_bias=k_bias, v_bias=v_bias)
    if has_qk_norm(hf_config):
        values.update({key: get(key).clone() for key in _QK_NORM_KEYS})
    named = {_HF_LAYER[key]: values[key] for key in _layer_keys(hf_config) if key != "experts"} | experts
    return {hf_prefix + name: named[name] for name in _layer_names(hf_config)}  # HF order


@dataclass(frozen=True)
class _Unit:
    """One piece of the streamed export: ``kind`` "embed" (embeddings; with tied embeddings also
    ``lm_head``), "layer" (one whole decoder layer) or "final" (final norm, or untied ``lm_head``),
    owned by pipeline stage ``stage``; ``index`` is the global layer number for layers.
    """

    kind: str
    stage: int
    index: int = -1


@dataclass(frozen=True)
class _Plan:
    """The export order (the same on every rank of the model-parallel group) and where ranks sit."""

    units: tuple[_Unit, ...]
    rank_at: dict[tuple[int, int], int]  # (pp_rank, tp_rank) -> global rank


def _export_plan(gpt, hf_config: Any, groups: ParallelGroups) -> _Plan:
    """Exchanges every rank's stage contents over the model-parallel group (one object all-gather)."""
    own = (dist.get_rank(), groups.tp_rank, groups.pp_rank, gpt.pre_process, gpt.post_process,
           [layer.layer_number - 1 for layer in gpt.decoder.layers])
    everyone = [own]
    if groups.mp_size > 1:
        everyone = [None] * groups.mp_size
        dist.all_gather_object(everyone, own, group=groups.mp_group)
    rank_at = {(pp, tp): rank for rank, tp, pp, *_ in everyone}
    first = next(pp for _, _, pp, pre, _, _ in everyone if pre)
    last = next(pp for _, _, pp, _, post, _ in everyone if post)
    layer_stage = {index: pp for _, _, pp, _, _, layers in everyone for index in layers}
    units = [_Unit("embed", first)]
    units += [_Unit("layer", layer_stage[index], index) for index in range(hf_config.num_hidden_layers)]
    units.append(_Unit("final", last))
    return _Plan(tuple(units), rank_at)


def _export_unit(gpt, params: dict, unit: _Unit, hf_config: Any, groups: ParallelGroups) -> dict:
    """HF tensors of ``unit`` on this rank of its owning stage (collective over the TP group)."""
    vocab = hf_config.vocab_size
    if unit.kind == "embed":
        return {_EMBED: _gather_tp(params["embedding.word_embeddings.weight"], 0, groups)[:vocab]}
    if unit.kind == "layer":
        local = next(i for i, layer in enumerate(gpt.decoder.layers) if layer.layer_number - 1 == unit.index)
        return _export_layer(params, f"decoder.layers.{local}.", f"model.layers.{unit.index}.", hf_config, groups)
    tensors = {_NORM: params["decoder.final_layernorm.weight"].detach().clone()}
    if not hf_config.tie_word_embeddings:
        tensors[_LM_HEAD] = _gather_tp(params["output_layer.weight"], 0, groups)[:vocab]
    return tensors


def _send_tensors(tensors: dict[str, torch.Tensor], dst: int) -> None:
    dist.send_object_list([[(name, t.shape, t.dtype) for name, t in tensors.items()]], dst=dst)
    for tensor in tensors.values():
        dist.send(tensor.contiguous(), dst=dst)


def _recv_tensors(src: int, device) -> dict[str, torch.Tensor]:
    meta = [None]
    dist.recv_object_list(meta, src=src)
    tensors = {}
    for name, shape, dtype in meta[0]:
        tensors[name] = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(tensors[name], src=src)
    return tensors


def _unit_at_dst(gpt, params, unit: _Unit, plan: _Plan, hf_config, groups, dst: int, dst_tp: int,
                 export=_export_unit):
    """``unit``'s HF tensors on rank ``dst`` (None on every other rank): gathered over TP on the owning
    stage (``export``, collective over TP), then sent point to point from that stage's TP rank
    ``dst_tp`` when it is not ``dst``.
    """
    me = dist.get_rank()
    tensors = export(gpt, params, unit, hf_config, groups) if unit.stage == groups.pp_rank else None
    src = plan.rank_at[(unit.stage, dst_tp)]
    if src != dst and me == src:
        _send_tensors(tensors, dst)
    elif src != dst and me == dst:
        tensors = _recv_tensors(src, next(gpt.parameters()).device)
    if me != dst:
        return None
    if unit.kind == "embed" and hf_config.tie_word_embeddings:
        tensors[_LM_HEAD] = tensors[_EMBED]  # the same tensor, as state_dict() lists it
    return tensors


def _destination(plan: _Plan, groups: ParallelGroups, dst_rank: int | None) -> tuple[int, int]:
    """``(global rank, its TP rank)`` an export is gathered on: ``dst_rank``, or the model-parallel
    group's first rank for None.

    Raises:
        ValueError: ``dst_rank`` outside this rank's model-parallel group.
    """
    dst = groups.mp_src_rank if dst_rank is None else dst_rank
    dst_tp = next((tp for (_, tp), rank in plan.rank_at.items() if rank == dst), None)
    if dst_tp is None:
        raise ValueError(f"dst_rank={dst_rank} is not in this rank's model-parallel group "
                         f"{sorted(plan.rank_at.values())}; pass the replica's engine rank (mp_src_rank)")
    return dst, dst_tp


def _adapter_pairs(kind: str, a: torch.Tensor, b: torch.Tensor, hf_config, groups) -> list:
    """``[(HF key, A, B)]`` of one LoRA layer gathered over TP (keys of ``_HF_LAYER``): a fused layer's
    adapter becomes one adapter per HF projection with the same ``A`` (its ``B`` split as the fused
    weight's rows are: q/k/v per KV group, gate/up per TP shard), which computes the same sum.
    """
    if kind == "linear_qkv":
        return [(key, a, part) for key, part in zip(("q", "k", "v"), _split_qkv(_gather_tp(b, 0, groups), hf_config),
                                                   strict=True)]
    if kind == "linear_fc1":
        return [(key, a, part) for key, part in zip(("gate", "up"), _gate_up(b, groups), strict=True)]
    # row-parallel: A split along the input like the weight, B whole
    return [("o" if kind == "linear_proj" else "down", _gather_tp(a, 1, groups), b)]


def _export_layer_adapters(gpt, params, unit: _Unit, hf_config, groups) -> dict:
    """One decoder layer's LoRA factors by HF module (``self_attn.q_proj.lora_A.weight`` [r, in],
    ``...lora_B.weight`` [out, r]; an expert's ``mlp.experts.{e}.gate_proj.lora_A.weight``, ...), gathered
    over TP (:func:`_adapter_pairs`) and, for the experts, over EP (global expert order).
    """
    layer = next(layer for layer in gpt.decoder.layers if layer.layer_number - 1 == unit.index)
    factors, experts = {}, {}
    for name, module in lora_layers(layer):
        pairs = _adapter_pairs(name.rsplit(".", 1)[-1], module.lora_A.detach(), module.lora_B.detach(), hf_config,
                               groups)
        if ".experts.local_experts." in name:
            for key, lora_a, lora_b in pairs:  # local experts in order, stacked below
                experts.setdefault(_HF_LAYER[key].rsplit(".", 2)[-2], []).append((lora_a, lora_b))
            continue
        for key, lora_a, lora_b in pairs:
            module_name = _HF_LAYER[key].removesuffix(".weight")
            factors[f"{module_name}.lora_A.weight"] = lora_a.clone()
            factors[f"{module_name}.lora_B.weight"] = lora_b.clone()
    if experts:
        stacked = {proj: _all_experts(pairs, groups) for proj, pairs in experts.items()}  # proj: [A, B], [E, ...]
        for expert in range(num_experts(hf_config)):
            for proj in (proj for proj in _EXPERT_PROJ if proj in stacked):
                for factor, tensor in zip(("lora_A", "lora_B"), stacked[proj], strict=True):
                    factors[f"mlp.experts.{expert}.{proj}.{factor}.weight"] = tensor[expert]
    prefix = f"model.layers.{unit.index}."
    return {prefix + name: tensor for name, tensor in factors.items()}


def export_hf_adapters(model: torch.nn.Module, hf_config: Any, *, dst_rank: int | None = None
                       ) -> dict[str, torch.Tensor]:
    """The LoRA adapters of a Megatron policy (:mod:`nemo_sspo.megatron.lora`) by Hugging Face module,
    as the ``peft`` library names them without its ``base_model.model.`` prefix
    (``model.layers.{l}.self_attn.q_proj.lora_A.weight`` [r, in], ``...lora_B.weight`` [out, r]), in
    layer order, gathered on ``dst_rank`` over TP and PP as :func:`iter_hf_weight_buckets` gathers
    weights. With ``s = alpha / r``, ``W + s * lora_B @ lora_A`` of every module is its merged weight.

    Collective over the model-parallel group. Returns ``{}`` on other ranks, and on every rank for a
    model without adapters.

    Args:
        model: this rank's Megatron policy stage (any wrapping).
        hf_config: its Hugging Face config.
        dst_rank: the global rank that receives them (a member of this rank's model-parallel group);
            None = the group's first rank.

    Raises:
        ValueError: ``dst_rank`` outside this rank's model-parallel group.
    """
    gpt = unwrap_model(model)
    groups = get_parallel_groups()
    plan = _export_plan(gpt, hf_config, groups)
    dst, dst_tp = _destination(plan, groups, dst_rank)
    adapters: dict[str, torch.Tensor] = {}
    for unit in plan.units:
        if unit.kind == "layer":
            tensors = _unit_at_dst(gpt, None, unit, plan, hf_config, groups, dst, dst_tp, export=_export_layer_adapters)
            adapters.update(tensors or {})
    return adapters


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of distinct storages (the tied head aliases the embeddings)."""
    unique = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors.values()}
    return sum(unique.values())


def iter_hf_weight_buckets(model: torch.nn.Module, hf_config: Any, bucket_bytes: int, *,
                           dst_rank: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Streamed export for refit: the HF Llama / Qwen2 / Qwen3 / Qwen3-MoE weights as buckets of whole decoder layers,
    gathered only on rank ``dst_rank`` (where the replica's rollout engine lives).

    Collective: every rank of the model-parallel group must iterate it to the end (the TP gathers,
    the object all-gather of the stage layout and the point-to-point sends from other pipeline
    stages run as it is iterated, in the same order on every rank). Unit by unit in HF order
    (embeddings, layers 0..L-1, final norm / head), the owning stage gathers the TP shards
    (all_gather over tp_group) and, when it is another stage, its TP rank matching ``dst_rank``'s
    sends them to ``dst_rank`` (send / recv). Qwen3-MoE under expert parallelism: each EP rank
    contributes its own experts of the layer being exported (one all-gather over ``ep_group`` per
    layer, run by every rank of the stage since each is the ``dst_rank`` of its own replica or
    feeds it), so no rank holds more than one layer's experts beyond its bucket; every rank of
    the EP group must iterate too.

    Buckets (on ``dst_rank``): HF name -> tensor dicts in HF key order (a tied head right after the
    embeddings), tensors on the model's device and dtype, vocabulary padding dropped. The embeddings (with tied embeddings also
    ``lm_head.weight``, the same tensor) form the first bucket(s); then as many whole decoder layers
    as fit ``bucket_bytes`` (a bucket never splits a layer, and holds at least one: a layer larger
    than ``bucket_bytes`` is a bucket on its own); then final norm and untied head, in their own
    bucket(s) by the same rule. Every HF key appears in exactly one bucket. On every other rank
    the iterator yields nothing.

    Peak extra memory: one bucket plus one unit in flight on ``dst_rank`` (release each bucket
    before taking the next); one unit on the other ranks.

    Args:
        model: this rank's (possibly DDP-wrapped) Megatron GPTModel stage.
        hf_config: its HF config (``num_hidden_layers``, ``vocab_size``, ``tie_word_embeddings``).
        bucket_bytes: bucket budget in bytes (``rollout.refit.bucket_mb`` * 2**20), > 0.
        dst_rank: global rank receiving the buckets, a member of this rank's model-parallel group;
            None = the group's first rank (``ParallelGroups.mp_src_rank``, the generating rank).

    Raises:
        ValueError: ``bucket_bytes <= 0``, or ``dst_rank`` outside this rank's model-parallel group.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
    gpt = unwrap_model(model)
    groups = get_parallel_groups()
    plan = _export_plan(gpt, hf_config, groups)
    dst, dst_tp = _destination(plan, groups, dst_rank)
    params = merged_parameters(gpt)
    bucket, size, kind = {}, 0, None
    for unit in plan.units:
        tensors = _unit_at_dst(gpt, params, unit, plan, hf_config, groups, dst, dst_tp)
        if tensors is None:
            continue
        nbytes = _nbytes(tensors)
        if bucket and (unit.kind != kind or size + nbytes > bucket_bytes):
            yield bucket
            bucket, size = {}, 0
        bucket.update(tensors)
        size, kind = size + nbytes, unit.kind
        del tensors  # the bucket holds them now; keep no second reference across the next yield
    if bucket:
        yield bucket


def _broadcast_tensors(tensors: dict[str, torch.Tensor] | None, src: int, group, device) -> dict:
    """``tensors`` of rank ``src`` on every rank of ``group`` (names / shapes / dtypes first)."""
    meta = [None if tensors is None else [(n, t.shape, t.dtype) for n, t in tensors.items()]]
    dist.broadcast_object_list(meta, src=src, group=group)
    out = {}
    for name, shape, dtype in meta[0]:
        tensor = tensors[name].contiguous() if tensors is not None else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, src=src, group=group)
        out[name] = tensor
    return out


def export_hf_state_dict(model: torch.nn.Module, hf_config: Any, *,
                         dst_rank: int | None = None) -> dict[str, torch.Tensor]:
    """Inverse of ``load_hf_into_megatron``: the full HF Llama / Qwen2 / Qwen3 / Qwen3-MoE state dict.

    Collective: all ranks of the model-parallel group must call it. The weights are gathered with
    :func:`iter_hf_weight_buckets` (one path) onto ``dst_rank``; with ``dst_rank=None`` they are
    then broadcast over the model-parallel group, so every rank holds the whole model (tests,
    gradient checks). Tensors are detached copies on the model's device and dtype, in HF key
    order, vocabulary padding dropped; with tied embeddings ``lm_head.weight`` is the same tensor
    as ``model.embed_tokens.weight``. Refit streams instead (``iter_hf_weight_buckets``), since
    this holds the whole model at once.

    Args:
        model: this rank's Megatron policy stage (unwrapped).
        hf_config: its Hugging Face config (names and shapes of the HF weights).
        dst_rank: global rank in this rank's model-parallel group that receives the dict (others
            get ``{}``), e.g. ``mp_src_rank`` to write a checkpoint; None = every rank.
    """
    groups = get_parallel_groups()
    dst = groups.mp_src_rank if dst_rank is None else dst_rank
    merged: dict[str, torch.Tensor] = {}
    for bucket in iter_hf_weight_buckets(model, hf_config, sys.maxsize, dst_rank=dst):
        merged.update(bucket)
    if hf_config.tie_word_embeddings:
        merged.pop(_LM_HEAD, None)  # re-added below as the embeddings themselves
    if dst_rank is None and groups.mp_size > 1:
        device = next(unwrap_model(model).parameters()).device
        merged = _broadcast_tensors(merged if dist.get_rank() == dst else None, dst, groups.mp_group, device)
    if not merged:
        return {}
    if hf_config.tie_word_embeddings:
        merged[_LM_HEAD] = merged[_EMBED]
    return {key: merged[key] for key in expected_hf_keys(hf_config)}
