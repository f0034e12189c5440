"""HF Llama / Qwen2 <-> Megatron-Core GPTModel weight mapping under tensor and pipeline parallelism.

Megatron layouts (per decoder layer; H = hidden, d = head_dim, G = num_key_value_heads,
Q = num_attention_heads / G query heads per group, F = intermediate_size):

- ``self_attention.linear_qkv.weight`` [G*(Q+2)*d, H]: per KV group g the rows are
  [q heads of g (Q*d), k_g (d), v_g (d)]; column-parallel, so TP rank r holds groups
  [r*G/tp, (r+1)*G/tp). HF q head h belongs to group h // Q (as ``repeat_kv``).
- ``self_attention.linear_qkv.bias`` [G*(Q+2)*d] (Qwen2 only): HF q/k/v biases in the same grouped
  order and the same TP slicing as the weight rows. Qwen2 has no o_proj or MLP biases.
- ``self_attention.linear_proj.weight`` [H, heads*d]: row-parallel, sliced on dim 1.
- ``mlp.linear_fc1.weight`` [2F, H]: each TP rank holds [gate shard; up shard] (the gated MLP
  chunks its local output in two), i.e. each half is sliced separately.
- ``mlp.linear_fc2.weight`` [H, F]: row-parallel, sliced on dim 1.
- RMSNorm weights: ``input_layernorm`` / ``pre_mlp_layernorm`` (local spec), or the norms fused
  into ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight`` (TransformerEngine spec).
- Embedding / output layer: [V_padded, H], sliced on dim 0; padded rows are zero.
- Local layer i on pipeline stage p is global layer ``layer.layer_number - 1``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from nemo_sspo.megatron.model import has_qkv_bias, padded_vocab_size, unwrap_model
from nemo_sspo.megatron.parallel_setup import ParallelGroups, get_parallel_groups

__all__ = ["export_hf_state_dict", "expected_hf_keys", "load_hf_into_megatron"]

_EMBED, _NORM, _LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
_HF_LAYER = {
    "q": "self_attn.q_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k": "self_attn.k_proj.weight",
    "k_bias": "self_attn.k_proj.bias",
    "v": "self_attn.v_proj.weight",
    "v_bias": "self_attn.v_proj.bias",
    "o": "self_attn.o_proj.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
    "ln1": "input_layernorm.weight",
    "ln2": "post_attention_layernorm.weight",
}
# Megatron parameter names per decoder layer; norms have a local-spec and a TE-spec name.
_MEG_LAYER = {
    "qkv": ("self_attention.linear_qkv.weight",),
    "qkv_bias": ("self_attention.linear_qkv.bias",),
    "proj": ("self_attention.linear_proj.weight",),
    "fc1": ("mlp.linear_fc1.weight",),
    "fc2": ("mlp.linear_fc2.weight",),
    "ln1": ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
    "ln2": ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
}


_BIAS_KEYS = ("q_bias", "k_bias", "v_bias")


def _layer_keys(hf_config: Any) -> list[str]:
    """Short names of one HF decoder layer's parameters, in HF order (q/k/v biases for Qwen2)."""
    bias = has_qkv_bias(hf_config)
    return [key for key in _HF_LAYER if bias or key not in _BIAS_KEYS]


def expected_hf_keys(hf_config: Any) -> list[str]:
    """HF parameter names of a Llama or Qwen2 model, in HF order (``lm_head`` also when tied, as
    transformers 5 ``state_dict()`` lists it)."""
    keys = [_EMBED]
    names = [_HF_LAYER[key] for key in _layer_keys(hf_config)]
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


def _layer_targets(hf: dict, hf_layer: int, prefix: str, params: dict, hf_config, groups) -> dict:
    def get(key: str) -> torch.Tensor:
        return hf[f"model.layers.{hf_layer}.{_HF_LAYER[key]}"]

    qkv = _fuse_qkv(get("q"), get("k"), get("v"), hf_config)
    fc1 = torch.cat([_shard(get("gate"), 0, groups), _shard(get("up"), 0, groups)], dim=0)
    targets = {}
    if has_qkv_bias(hf_config):
        qkv_bias = _fuse_qkv(get("q_bias"), get("k_bias"), get("v_bias"), hf_config)
        targets[_resolve(params, prefix, _MEG_LAYER["qkv_bias"])] = _shard(qkv_bias, 0, groups)
    return targets | {
        _resolve(params, prefix, _MEG_LAYER["qkv"]): _shard(qkv, 0, groups),
        _resolve(params, prefix, _MEG_LAYER["proj"]): _shard(get("o"), 1, groups),
        _resolve(params, prefix, _MEG_LAYER["fc1"]): fc1,
        _resolve(params, prefix, _MEG_LAYER["fc2"]): _shard(get("down"), 1, groups),
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
    """Copy a full HF Llama / Qwen2 state dict into this rank's (TP shard, PP stage) Megatron model.

    Every rank passes the full HF dict; each copies only its slices (see module docstring), cast
    to the parameter's dtype and device. No communication.

    Raises:
        ValueError: listing missing / unexpected HF keys, Megatron parameters the mapping does not
            cover (or names it produced that the model lacks), or shape mismatches.
    """
    _check_hf_keys(hf_state_dict, hf_config)
    gpt = unwrap_model(model)
    params = dict(gpt.named_parameters())
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
    return shards if dim is None else torch.cat(shards, dim=dim)


def _export_layer(params: dict, prefix: str, hf_prefix: str, hf_config, groups) -> dict:
    def get(key: str) -> torch.Tensor:
        return params[_resolve(params, prefix, _MEG_LAYER[key])].detach()

    q, k, v = _split_qkv(_gather_tp(get("qkv"), 0, groups), hf_config)
    fc1_shards = _gather_tp(get("fc1"), None, groups)
    halves = [shard.chunk(2, dim=0) for shard in fc1_shards]
    values = {
        "q": q, "k": k, "v": v,
        "o": _gather_tp(get("proj"), 1, groups),
        "gate": torch.cat([gate for gate, _ in halves], dim=0),
        "up": torch.cat([up for _, up in halves], dim=0),
        "down": _gather_tp(get("fc2"), 1, groups),
        "ln1": get("ln1").clone(),
        "ln2": get("ln2").clone(),
    }
    if has_qkv_bias(hf_config):
        q_bias, k_bias, v_bias = _split_qkv(_gather_tp(get("qkv_bias"), 0, groups), hf_config)
        values.update(q_bias=q_bias, k_bias=k_bias, v_bias=v_bias)
    return {hf_prefix + _HF_LAYER[key]: value for key, value in values.items()}


def _export_stage(gpt, hf_config: Any, groups: ParallelGroups) -> dict[str, torch.Tensor]:
    """This pipeline stage's HF tensors, gathered over TP (collective over the TP group)."""
    params = dict(gpt.named_parameters())
    vocab = hf_config.vocab_size
    stage = {}
    if gpt.pre_process:
        stage[_EMBED] = _gather_tp(params["embedding.word_embeddings.weight"], 0, groups)[:vocab]
    for index, layer in enumerate(gpt.decoder.layers):
        hf_prefix = f"model.layers.{layer.layer_number - 1}."
        prefix = f"decoder.layers.{index}."
        stage.update(_export_layer(params, prefix, hf_prefix, hf_config, groups))
    if gpt.post_process:
        stage[_NORM] = params["decoder.final_layernorm.weight"].detach().clone()
        if not hf_config.tie_word_embeddings:
            stage[_LM_HEAD] = _gather_tp(params["output_layer.weight"], 0, groups)[:vocab]
    return stage


def _broadcast_stages(stage: dict[str, torch.Tensor], groups: ParallelGroups, device) -> dict:
    """Union of every pipeline stage's dict on every rank of the PP group."""
    merged: dict[str, torch.Tensor] = {}
    for src in range(groups.pp_size):
        src_global = dist.get_global_rank(groups.pp_group, src)
        own = src == groups.pp_rank
        entries = [(name, tensor.shape, tensor.dtype) for name, tensor in stage.items()]
        meta = [entries if own else None]
        dist.broadcast_object_list(meta, src=src_global, group=groups.pp_group)
        for name, shape, dtype in meta[0]:
            if own:
                tensor = stage[name].contiguous()
            else:
                tensor = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(tensor, src=src_global, group=groups.pp_group)
            merged[name] = tensor
    return merged


def export_hf_state_dict(model: torch.nn.Module, hf_config: Any) -> dict[str, torch.Tensor]:
    """Inverse of ``load_hf_into_megatron``: the full HF Llama / Qwen2 state dict, on EVERY rank.

    Collective: all ranks of the model-parallel group must call it. Gathers TP shards (all_gather
    over tp_group) and pipeline stages (broadcast over pp_group); vocabulary padding is dropped.
    Tensors are detached copies on the model's device and dtype, in HF key order; with tied
    embeddings ``lm_head.weight`` is the same tensor as ``model.embed_tokens.weight``. Used for
    refit (Megatron -> rollout model) after each optimizer step.
    """
    gpt = unwrap_model(model)
    groups = get_parallel_groups()
    stage = _export_stage(gpt, hf_config, groups)
    device = next(gpt.parameters()).device
    merged = _broadcast_stages(stage, groups, device) if groups.pp_size > 1 else stage
    if hf_config.tie_word_embeddings:
        merged[_LM_HEAD] = merged[_EMBED]
    return {key: merged[key] for key in expected_hf_keys(hf_config)}
