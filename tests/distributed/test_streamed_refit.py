"""Streamed refit export (``iter_hf_weight_buckets``) under TP=2, PP=2 and TP=2 x PP=2 (world 4, gloo).

The reference is the HF state dict the Megatron model was loaded from (the mapping is bit-exact in
fp32) and ``export_hf_state_dict`` on every rank. Checks: the buckets' union is every HF tensor bit for
bit, in HF key order, each key once; buckets hold whole layers, packed greedily up to the budget
(a layer larger than the budget goes alone); embeddings and final norm / head sit in their own
buckets; only the destination rank (the replica's engine rank by default) receives anything.
"""

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from nemo_sspo.megatron import export_hf_state_dict, iter_hf_weight_buckets
from tests.distributed._megatron_layouts import check_world_4_layouts, megatron_layout
from tests.unit.mapping_cases import TINY, megatron_copy

LAYERS = 4


def _config(tied: bool) -> LlamaConfig:
    return LlamaConfig(**(TINY | dict(num_hidden_layers=LAYERS, tie_word_embeddings=tied)))


def _layer_of(name: str) -> int | None:
    return int(name.split(".")[2]) if name.startswith("model.layers.") else None


def _layer_bytes(hf_state: dict, layer: int) -> int:
    return sum(t.numel() * t.element_size() for n, t in hf_state.items() if _layer_of(n) == layer)


def _check_buckets(buckets: list[dict], hf_state: dict, full: dict, budget: int, tied: bool) -> list[list[int]]:
    """Asserts the bucket rules; returns the layer indices of each layer bucket."""
    names = [name for bucket in buckets for name in bucket]
    order = list(hf_state)
    if tied:  # the tied head travels with the embeddings (it is the same tensor)
        order.remove("lm_head.weight")
        order.insert(1, "lm_head.weight")
    assert names == order, names  # every key exactly once, in HF order
    for bucket in buckets:
        for name, tensor in bucket.items():
            assert torch.equal(tensor, hf_state[name]) and torch.equal(tensor, full[name]), name
    head = ["model.embed_tokens.weight"] + (["lm_head.weight"] if tied else [])
    assert list(buckets[0]) == head
    if tied:
        assert buckets[0]["lm_head.weight"] is buckets[0]["model.embed_tokens.weight"]
    assert list(buckets[-1]) == ["model.norm.weight"] + ([] if tied else ["lm_head.weight"])
    layer_buckets = []
    for bucket in buckets[1:-1]:
        layers = sorted({_layer_of(name) for name in bucket})
        assert None not in layers  # layers never share a bucket with embeddings, norm or head
        for layer in layers:  # never a split layer
            assert {n for n in hf_state if _layer_of(n) == layer} <= bucket.keys()
        size = sum(_layer_bytes(hf_state, layer) for layer in layers)
        assert size <= budget or len(layers) == 1
        layer_buckets.append(layers)
    return layer_buckets


def _check_layout(tp: int, pp: int, tied: bool) -> None:
    config = _config(tied)
    torch.manual_seed(1234)  # the same HF weights on every rank
    hf_state = LlamaForCausalLM(config).state_dict()
    layer_bytes = _layer_bytes(hf_state, 0)  # 4 * (64x64 q/o) + 2 * (32x64 k/v) + 3 * (96x64) + 2 * 64 floats
    assert layer_bytes == 4 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 96 * 64 + 2 * 64)
    with megatron_layout(tp, pp) as groups:
        model = megatron_copy(config, hf_state)
        full = export_hf_state_dict(model, config)
        engine_rank = dist.get_rank() == groups.mp_src_rank
        # 2.5 layers per bucket -> [[0, 1], [2, 3]]; 1 byte (smaller than any layer) -> one layer each
        for budget, expected in ((layer_bytes * 5 // 2, [[0, 1], [2, 3]]), (1, [[0], [1], [2], [3]])):
            buckets = list(iter_hf_weight_buckets(model, config, budget))
            if engine_rank:
                assert _check_buckets(buckets, hf_state, full, budget, tied) == expected, (tp, pp, tied, budget)
            else:
                assert buckets == [], (dist.get_rank(), [list(b) for b in buckets])
        # any member of the model-parallel group can be the destination: here its last rank
        last = dist.get_global_rank(groups.mp_group, groups.mp_size - 1)
        buckets = list(iter_hf_weight_buckets(model, config, 1 << 20, dst_rank=last))
        if dist.get_rank() == last:
            _check_buckets(buckets, hf_state, full, 1 << 20, tied)
        else:
            assert buckets == []
        # the checkpoint export gathers on one rank only
        only = export_hf_state_dict(model, config, dst_rank=groups.mp_src_rank)
        assert (list(only) == list(hf_state)) if engine_rank else only == {}
        if groups.dp_size > 1:  # the other replica's engine rank is not in this group
            mine = dist.get_process_group_ranks(groups.mp_group)
            other = next(r for r in range(dist.get_world_size()) if r not in mine)
            try:
                list(iter_hf_weight_buckets(model, config, 1, dst_rank=other))
                raise AssertionError("dst_rank outside the model-parallel group was accepted")
            except ValueError as err:
                assert "model-parallel group" in str(err)


def _all_layouts(rank: int, world_size: int) -> None:
    check_world_4_layouts(_check_layout)


def test_streamed_refit_equals_full_export_and_only_reaches_the_engine_rank(run_distributed):
    # 4 spawned ranks each import Megatron + transformers on a shared 2-core host: allow 300 s.
    run_distributed(_all_layouts, 4, timeout_s=300)
