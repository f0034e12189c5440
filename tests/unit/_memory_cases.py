"""Shared by the memory-plan tests (one process and gloo): tiny models built with megatron-core, the
bytes of their DDP buffers and optimizer states, and the bytes their forward saves for the backward.

Nothing here uses the plan's code: every figure is counted from built objects or autograd hooks.
"""

from __future__ import annotations

import copy
import dataclasses
from contextlib import contextmanager
from functools import cache

import torch
from transformers import LlamaConfig, Qwen3Config

from nemo_sspo.algorithms.micro_batches import packed_positions
from nemo_sspo.megatron import build_policy_model
from nemo_sspo.megatron import model as model_module
from nemo_sspo.megatron.cpu_shims import cpu_device_context
from nemo_sspo.megatron.model import forward_hidden, unwrap_model
from nemo_sspo.models import SOURCES, load_hf_config


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


def build_trained(hf_config, *, precision: str, distributed: bool, seed: int = 0, lora=None):
    """A model wrapped in megatron's DDP (fp32 grad buffers, no overlap: our ``wrap_for_training``)
    with megatron's Adam, after one forward/backward and one optimizer step (Adam's states exist);
    ``lora``: its ``LoraSettings`` (adapters, base frozen), or None.

    Returns ``(ddp, optimizer)``.
    """
    from nemo_sspo.megatron.training import wrap_for_training

    torch.manual_seed(seed)
    model = build_policy_model(hf_config, precision=precision, lora=lora).train()
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
    """Bytes of the built objects: the module's parameters (for the trained ones the distributed
    optimizer's parameter buffers instead when it made them; frozen ones are never in a buffer),
    DDP's grad buffers, and the optimizer's fp32 main weights (when separate from the parameters)
    and Adam ``exp_avg`` / ``exp_avg_sq`` tensors."""
    buffers = ddp.buffers + ddp.expert_parallel_buffers
    weights = sum(p.numel() * p.element_size() for p in ddp.module.parameters() if not p.requires_grad)
    if all(b.param_data is not None for b in buffers):
        weights += sum(b.param_data.numel() * b.param_data.element_size() for b in buffers)
    else:
        weights += sum(p.numel() * p.element_size() for p in ddp.module.parameters() if p.requires_grad)
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


def saved_activation_bytes(model, input_ids, position_ids, sequence_lengths=None,
                           stage_input: torch.Tensor | None = None) -> int:
    """Bytes the forward (to the final hidden states) saves for its backward: the distinct storages
    that ``torch.autograd.graph.saved_tensors_hooks`` sees, parameters excluded (they are weights).
    ``stage_input``: a later pipeline stage's input ``[S, B, H]`` (what the previous stage sends)."""
    if stage_input is not None:
        unwrap_model(model).set_input_tensor(stage_input)
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


# The grid of tests/unit/megatron/test_memory_grid.py and tests/distributed/test_memory_grid_parallel.py.

GRID_VOCAB = 256
"""Vocabulary of the grid's models: the activations before the output layer do not depend on it, and
the tiny Qwens' 151,936 rows would make every build slow."""
GRID_PRECISIONS = ("fp32", "bf16")
GRID_RECOMPUTE = ("none", "selective", "full")
GRID_ROWS, GRID_WIDTH, GRID_PACKED = 2, 40, [30, 26, 24]
"""Padded: 2 rows of 40; packed: one row of 80 tokens (three sequences)."""


@dataclasses.dataclass(frozen=True)
class GridCase:
    """One model under one layout: ``tp``, ``pp``, ``ep``, ``sp`` (sequence parallelism), a precision
    and a recomputation; measured padded and packed."""

    model: str
    tp: int
    pp: int
    ep: int
    sp: bool
    precision: str
    recompute: str

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.ep


@cache
def grid_models() -> dict[str, object]:
    """Every shipped tiny model (the ``tiny-random-*`` names of :data:`nemo_sspo.models.SOURCES`, so a
    family added there joins the grid), its HF config with the vocabulary cut to :data:`GRID_VOCAB`."""
    models = {}
    for name in (s for s in SOURCES if s.startswith("tiny-random")):
        config = copy.deepcopy(load_hf_config(name))
        config.vocab_size = GRID_VOCAB
        models[name] = config
    return models


def grid_layouts(config) -> list[tuple[int, int, int, bool]]:
    """``(tp, pp, ep, sp)`` layouts a model meets: TP 1, TP 2 without and with sequence parallelism,
    PP 2, and EP 2 for MoE models (megatron-core trains MoE layers under TP only with sequence
    parallelism, and the config check refuses TP 2 without it)."""
    moe = getattr(config, "num_experts", None) is not None
    layouts = [(1, 1, 1, False), (2, 1, 1, False), (2, 1, 1, True), (1, 2, 1, False)]
    if moe:
        layouts = [lay for lay in layouts if lay != (2, 1, 1, False)] + [(1, 1, 2, False)]
    return layouts


def grid_cases() -> list[GridCase]:
    """A covering set: model ``i``'s layout ``j`` runs precision ``(i + j) % 2`` and recomputation
    ``(i + j) % 3``; with at least 3 layouts per model, every model meets every precision and
    recomputation, and every case is measured padded and packed."""
    cases = []
    for i, (name, config) in enumerate(grid_models().items()):
        for j, (tp, pp, ep, sp) in enumerate(grid_layouts(config)):
            cases.append(GridCase(name, tp, pp, ep, sp, GRID_PRECISIONS[(i + j) % 2],
                                  GRID_RECOMPUTE[(i + j) % 3]))
    return cases


@contextmanager
def counting_routed_tokens(model):
    """Yields a list that gets, per MoE layer the forward runs, the token-expert pairs this rank's
    experts processed (the rows of the permuted tokens handed to ``experts``)."""
    counts: list[int] = []
    handles = [module.register_forward_pre_hook(lambda _m, args: counts.append(int(args[0].shape[0])))
               for name, module in unwrap_model(model).named_modules() if name.endswith("mlp.experts")]
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()


def measure_grid_case(case: GridCase, stage: int) -> dict[str, tuple[int, float | None]]:
    """Builds ``case``'s model under the current parallel state (this rank's ``stage``; a bf16 model in
    megatron's ``Float16Module``, as ``wrap_for_training`` trains it) and measures one padded and one
    packed forward: ``{"padded" | "packed": (saved bytes, mean routed pairs per MoE layer or None)}``."""
    from megatron.core.transformer.module import Float16Module

    config = grid_models()[case.model]
    torch.manual_seed(0)
    model = build_policy_model(config, precision=case.precision, transformer_impl="local",
                               recompute=case.recompute, sequence_parallel=case.sp).train()
    if case.precision == "bf16":
        model = Float16Module(unwrap_model(model).config, model)
    dtype = torch.bfloat16 if case.precision == "bf16" else torch.float32
    (ids, pos), (packed, packed_pos, lengths) = padded_and_packed_inputs(
        config.vocab_size, GRID_ROWS, GRID_WIDTH, GRID_PACKED)
    out = {}
    for name, inputs in (("padded", (ids, pos, None)), ("packed", (packed, packed_pos, lengths))):
        rows, width = inputs[0].shape
        stage_input = None
        if stage > 0:  # what the previous stage sends: [S, B, H] in the model's dtype (as on a GPU;
            # on CPU the shims' pipeline_dtype is fp32)
            stage_input = torch.randn(width // (case.tp if case.sp else 1), rows, config.hidden_size,
                                      dtype=dtype, requires_grad=True)
        with counting_routed_tokens(model) as routed:
            measured = saved_activation_bytes(model, *inputs, stage_input=stage_input)
        out[name] = (measured, sum(routed) / len(routed) if routed else None)
    return out
