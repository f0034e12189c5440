"""Shared by the memory-plan tests (one process and gloo): tiny models built with megatron-core, the
bytes of their DDP buffers and optimizer states, and the bytes their forward saves for the backward.

Nothing here uses the plan's code: every figure is counted from built objects or autograd hooks.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch
from transformers import LlamaConfig, Qwen3Config

from nemo_sspo.algorithms.micro_batches import packed_positions
from nemo_sspo.megatron import build_policy_model
from nemo_sspo.megatron import model as model_module
from nemo_sspo.megatron.cpu_shims import cpu_device_context
from nemo_sspo.megatron.model import forward_hidden


def llama(**overrides) -> LlamaConfig:
    """Hidden 64, 4 heads / 2 KV heads of 16, SwiGLU width 160 (distinct from every other width), 2 layers."""
    fields = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=200, tie_word_embeddings=False, rope_theta=500.0,
                  max_position_embeddings=256, rms_norm_eps=1e-6)
    return LlamaConfig(**{**fields, **overrides})


def qwen3(**overrides) -> Qwen3Config:
    """Qwen3 in miniature (q/k norms, tied embeddings, head_dim 32 apart from hidden / heads)."""
    fields = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, vocab_size=300, tie_word_embeddings=True,
                  max_position_embeddings=256, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return Qwen3Config(**{**fields, **overrides})


@contextmanager
def recompute(granularity: str | None, method: str = "uniform", num_layers: int = 1):
    """Builds inside get megatron-core's own recomputation fields on their TransformerConfig.

    (On CPU the shims of ``nemo_sspo.megatron.cpu_shims`` let megatron's recomputation run.)"""
    original = model_module.transformer_config_from_hf

    def patched(*args, **kwargs):
        config = original(*args, **kwargs)
        if granularity is None:
            return config
        extra = {"recompute_granularity": granularity}
        if granularity == "full":
            extra.update(recompute_method=method, recompute_num_layers=num_layers)
        return dataclasses.replace(config, **extra)

    model_module.transformer_config_from_hf = patched
    try:
        yield
    finally:
        model_module.transformer_config_from_hf = original


def build_trained(hf_config, *, precision: str, distributed: bool, seed: int = 0):
    """A model wrapped in megatron's DDP (fp32 grad buffers, no overlap: our ``wrap_for_training``)
    with megatron's Adam, after one forward/backward and one optimizer step (Adam's states exist).

    Returns ``(ddp, optimizer)``.
    """
    from nemo_sspo.megatron.training import wrap_for_training

    torch.manual_seed(seed)
    model = build_policy_model(hf_config, precision=precision).train()
    ddp, optimizer = wrap_for_training(model, lr=1e-3, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
                                       adam_eps=1e-8, clip_grad=0.0, use_distributed_optimizer=distributed)
    with cpu_device_context():
        ids = torch.randint(0, hf_config.vocab_size, (2, 8))
        hidden = forward_hidden(ddp, ids, torch.arange(8).expand(2, 8))
        hidden.float().pow(2).mean().backward()
        ddp.finish_grad_sync()
        optimizer.step()
    return ddp, optimizer


def counted_state_bytes(ddp, optimizer) -> dict[str, int]:
    """Bytes of the built objects: the module's parameters (the distributed optimizer's parameter
    buffers instead when it made them), DDP's grad buffers, and the optimizer's fp32 main weights
    (when separate from the parameters) and Adam ``exp_avg`` / ``exp_avg_sq`` tensors."""
    buffers = ddp.buffers + ddp.expert_parallel_buffers
    if all(b.param_data is not None for b in buffers):
        weights = sum(b.param_data.numel() * b.param_data.element_size() for b in buffers)
    else:
        weights = sum(p.numel() * p.element_size() for p in ddp.module.parameters())
    gradients = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
    model_ptrs = {p.untyped_storage().data_ptr() for p in ddp.module.parameters()}
    model_ptrs |= {b.param_data.untyped_storage().data_ptr() for b in buffers if b.param_data is not None}
    states = 0
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in inner.optimizer.param_groups:
            for param in group["params"]:
                if param.untyped_storage().data_ptr() not in model_ptrs:  # an fp32 main copy
                    states += param.numel() * param.element_size()
                state = inner.optimizer.state.get(param, {})
                states += sum(state[k].numel() * state[k].element_size() for k in ("exp_avg", "exp_avg_sq"))
    return {"weights": weights, "gradients": gradients, "optimizer": states}


def saved_activation_bytes(model, input_ids, position_ids, sequence_lengths=None) -> int:
    """Bytes the forward (to the final hidden states) saves for its backward: the distinct storages
    that ``torch.autograd.graph.saved_tensors_hooks`` sees, parameters excluded (they are weights)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward_hidden(model, input_ids, position_ids, sequence_lengths=sequence_lengths)
    return sum(seen.values())


def padded_and_packed_inputs(vocab: int, rows: int, width: int, lengths: list[int]):
    """``(ids, positions)`` of ``rows`` right-padded rows of ``width``, and ``(ids, positions,
    lengths)`` of one packed row of sequences of ``lengths``."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, width), generator=generator)
    lengths_t = torch.tensor(lengths)
    packed = torch.randint(0, vocab, (1, int(lengths_t.sum())), generator=generator)
    return (ids, torch.arange(width).expand(rows, width)), (packed, packed_positions(lengths_t)[None, :], lengths_t)
