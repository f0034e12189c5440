"""Low-rank adapters (LoRA) on megatron-core's tensor-parallel linear layers.

A LoRA layer computes ``y = x W^T + s * dropout(x) A^T B^T`` with the base weight ``W`` [out, in]
frozen, ``A`` [r, in] drawn at random, ``B`` [out, r] zero (so a fresh adapter leaves the model's
output exactly as it was) and ``s = alpha / r`` (Hu et al., "LoRA: Low-Rank Adaptation of Large
Language Models", 2021, eq. 3 and section 4.1; the ``alpha / r`` scale is theirs, the dropout on the
adapter's input is the ``peft`` library's).

Each adapter is split the way its base layer is, so a tensor-parallel run computes what one rank
computes (how it is split and which gradients are partial sums is ours, following megatron-core's
own layers):

* **column-parallel** base (``linear_qkv``, ``linear_fc1``; ``W`` split along its output rows): ``B``
  is split along its rows like ``W``, ``A`` is whole on every TP rank. The low-rank activation
  ``u = x A^T`` [s, b, r] enters the tensor-parallel region as the base layer's input does: without
  sequence parallelism through an identity whose backward all-reduces ``dL/du`` (each rank's ``B``
  shard gives a partial sum), so ``A``'s gradient is whole on every rank; with sequence parallelism
  ``u`` is computed on the rank's sequence shard and all-gathered (reduce-scattered in the backward),
  so ``A``'s gradient covers the shard's tokens and is summed over TP in ``finalize_model_grads``
  (the ``sequence_parallel`` parameter attribute megatron-core's norms carry).
* **row-parallel** base (``linear_proj``, ``linear_fc2``; ``W`` split along its input columns):
  ``A`` is split along its columns like ``W``, ``B`` is whole. The partial products ``x_t A_t^T`` are
  all-reduced over TP (reduce-scattered to the sequence shards under sequence parallelism, where
  ``B``'s gradient is then summed over TP like ``A``'s above).

Both ways, this rank's merged weight is its own shard ``W_t + s * B_t A_t``: merging needs no
communication, and the merged shards gather into the merged HF weight like the base shards do.

* **experts** (``linear_fc1`` / ``linear_fc2`` of each expert of a mixture-of-experts layer; a
  shared expert, which no supported model family has, is a dense MLP to its adapters): every expert
  has its own adapter, held by the EP rank that holds the expert and
  split over the expert-TP group like the expert's weights. The token dispatcher does the expert
  layers' communication (megatron-core's ``explicit_expert_comm``): each expert-TP rank sees all the
  expert's tokens and its outputs are partial sums the dispatcher reduces. The adapter follows the
  same rule with no communication of its own: fc1's ``x A^T B_t^T`` and fc2's ``x_t A_t^T B^T`` are
  this rank's partial sums. The whole factor's gradient is then a partial sum over the expert-TP
  group; megatron-core runs MoE under TP > 1 only with sequence parallelism, where the factor's
  ``sequence_parallel`` mark sums it over TP (the expert-TP group, as expert TP = TP here). Like the
  expert weights, expert factors under EP > 1 carry ``allreduce=False``: DDP reduces them over the
  expert data-parallel group.

The base weights are frozen (``requires_grad=False``): megatron-core's DDP allocates no gradient
buffer and its optimizers (the distributed one too) keep no state for them.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from nemo_sspo.choice import Choice
from nemo_sspo.megatron.moe import global_expert

__all__ = [
    "LoraRefit",
    "LoraSettings",
    "LoraTarget",
    "adapter_parameters",
    "adapters_disabled",
    "base_parameters",
    "initialize_adapters",
    "lora_layers",
    "merged_parameters",
    "with_adapters",
]


class LoraTarget(Choice):
    """The linear layers of a decoder layer that take an adapter (key ``model.lora.target``), by
    megatron-core's module names (Megatron-Bridge's LoRA uses the same): ``linear_qkv`` (fused q/k/v
    projection; HF ``q_proj``, ``k_proj``, ``v_proj``), ``linear_proj`` (attention output, ``o_proj``),
    ``linear_fc1`` (fused gate/up projection, ``gate_proj`` + ``up_proj``), ``linear_fc2`` (``down_proj``).
    """

    linear_qkv = "linear_qkv"
    linear_proj = "linear_proj"
    linear_fc1 = "linear_fc1"
    linear_fc2 = "linear_fc2"


class LoraRefit(Choice):
    """What a refit sends the rollout engine under LoRA (key ``model.lora.refit``): ``merged`` weights
    (``W + (alpha / r) B A``, every weight) or the ``adapters`` alone (an engine that serves LoRA).
    """

    merged = "merged"
    adapters = "adapters"


@dataclass(frozen=True)
class LoraSettings:
    """What :func:`with_adapters` builds (the ``model.lora`` section with the run's seed).

    Attributes:
        rank: r, the adapters' inner dimension, >= 1.
        alpha: the scale numerator: the adapter's output is multiplied by ``alpha / rank``.
        dropout: dropout probability on the adapter's input while training, in [0, 1).
        targets: the :class:`LoraTarget` names that get adapters.
        seed: seeds ``A``'s draw (with each layer's global index and module name, so the draw does
            not depend on the parallel layout).
    """

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    seed: int = 0

    @property
    def scaling(self) -> float:
        """``alpha / rank`` (Hu et al. 2021, section 4.1)."""
        return self.alpha / self.rank


class _LoraMixin:
    """The adapter of one megatron-core linear layer (module docstring); mixed into the layer's own class.

    Parameters: ``lora_A`` [r, in_local] and ``lora_B`` [out_local, r] in the base weight's dtype
    and device, where ``in_local`` / ``out_local`` are this rank's input / output widths of the base layer.
    """

    lora_scaling: float
    adapters_enabled: bool
    _row_parallel: bool

    def __init__(self, *args, lora: LoraSettings, **kwargs):  # noqa: D107 - on the class
        super().__init__(*args, **kwargs)  # the base layer's own arguments
        self._add_adapter(lora)

    def _add_adapter(self, settings: LoraSettings) -> None:
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        out_local, in_local = self.weight.shape
        kind = dict(dtype=self.weight.dtype, device=self.weight.device)
        self.lora_A = torch.nn.Parameter(torch.empty(settings.rank, in_local, **kind))
        self.lora_B = torch.nn.Parameter(torch.zeros(out_local, settings.rank, **kind))
        split, whole = (self.lora_A, self.lora_B) if self._row_parallel else (self.lora_B, self.lora_A)
        set_tensor_model_parallel_attributes(split, True, 1 if self._row_parallel else 0, 1)
        # Under sequence parallelism the whole factor's gradient covers this rank's tokens only (a
        # dense layer) or this expert-TP rank's partial sum (an expert).
        whole.sequence_parallel = self.sequence_parallel
        for factor in (self.lora_A, self.lora_B):  # False for an expert under EP: the expert-DP reduction
            factor.allreduce = getattr(self.weight, "allreduce", True)
        self.lora_scaling, self.lora_dropout = settings.scaling, settings.dropout
        self.adapters_enabled = True
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def _adapter_input(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The base layer's checkpoint entries and the adapter's: the split factor sharded over TP
        along the base weight's split axis, the whole factor replicated.
        """
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axes = {"weight": 1, "lora_A": 1} if self._row_parallel else {"weight": 0, "bias": 0, "lora_B": 0}
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, axes,
                                                   sharded_offsets)

    def merged_weight(self) -> torch.Tensor:
        """This rank's shard of ``W + s * B A``, computed in float32 and cast once to ``W``'s dtype
        (``[out_local, in_local]``, detached).
        """
        delta = self.lora_B.detach().float() @ self.lora_A.detach().float()
        return (self.weight.detach().float() + self.lora_scaling * delta).to(self.weight.dtype)


def _column_class(base: type) -> type:
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    class LoraColumnParallelLinear(_LoraMixin, base):
        """``base`` (a megatron-core column-parallel linear layer) with an adapter (module docstring)."""

        _row_parallel = False

        def forward(self, input_, *args, **kwargs):  # noqa: D102 - the base layer's, plus the adapter
            output, bias = super().forward(input_, *args, **kwargs)
            if not self.adapters_enabled:
                return output, bias
            low = self._adapter_input(input_) @ self.lora_A.t()
            if self.explicit_expert_comm:
                pass  # an expert: the dispatcher gathered the tokens and reduces this rank's partial output
            elif self.sequence_parallel:
                low = gather_from_sequence_parallel_region(low, tensor_parallel_output_grad=True, group=self.tp_group)
            else:
                low = copy_to_tensor_model_parallel_region(low, group=self.tp_group)
            return output + self.lora_scaling * (low @ self.lora_B.t()), bias

    return LoraColumnParallelLinear


def _row_class(base: type) -> type:
    from megatron.core.tensor_parallel.mappings import (
        reduce_from_tensor_model_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )

    class LoraRowParallelLinear(_LoraMixin, base):
        """``base`` (a megatron-core row-parallel linear layer) with an adapter (module docstring)."""

        _row_parallel = True

        def forward(self, input_):  # noqa: D102 - the base layer's, plus the adapter
            output, bias = super().forward(input_)
            if not self.adapters_enabled:
                return output, bias
            partial = self._adapter_input(input_) @ self.lora_A.t()
            if self.explicit_expert_comm:
                low = partial  # an expert: the dispatcher reduces the partial output, B's term included
            elif self.sequence_parallel:
                low = reduce_scatter_to_sequence_parallel_region(partial, group=self.tp_group)
            else:
                low = reduce_from_tensor_model_parallel_region(partial, group=self.tp_group)
            return output + self.lora_scaling * (low @ self.lora_B.t()), bias

    return LoraRowParallelLinear


def _mlp_owners(mlp_spec) -> list:
    """The ``MLPSubmodules`` of a layer's MLP spec: the dense MLP's, or a mixture-of-experts layer's
    experts' and shared expert's (each built only where the model has it).
    """
    submodules = getattr(mlp_spec, "submodules", None)
    if hasattr(submodules, "linear_fc1"):
        return [submodules]
    owners = []
    for spec in (submodules.experts, submodules.shared_experts):
        if spec is not None and spec.submodules is None:
            raise ValueError(f"lora.target: the experts are megatron-core's {spec.module.__name__}, whose "
                             "weights are not linear layers that take an adapter; adapters go on the local "
                             "spec's SequentialMLP experts (moe_grouped_gemm off)")
        if spec is not None:
            owners.append(spec.submodules)
    return owners


def with_adapters(submodules, settings: LoraSettings) -> None:
    """Puts adapters into a local layer spec: each targeted linear layer of ``submodules`` (a
    ``TransformerLayerSubmodules``) is replaced by a ``ModuleSpec`` of its LoRA class, in place.
    ``linear_fc1`` / ``linear_fc2`` of a mixture-of-experts layer are those of each expert (megatron-core's
    ``SequentialMLP``) and of its shared expert; the router takes no adapter.

    Raises:
        ValueError: a targeted layer that is not megatron-core's ``ColumnParallelLinear`` /
            ``RowParallelLinear``, such as the grouped-GEMM experts (naming ``lora.target``).
    """
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    attention = submodules.self_attention.submodules
    owners = {"linear_qkv": [attention], "linear_proj": [attention]}
    if {"linear_fc1", "linear_fc2"} & set(settings.targets):
        owners["linear_fc1"] = owners["linear_fc2"] = _mlp_owners(submodules.mlp)
    for target in settings.targets:
        for owner in owners[target]:
            base = getattr(owner, target, None)
            if base is ColumnParallelLinear:
                wrapped = _column_class(base)
            elif base is RowParallelLinear:
                wrapped = _row_class(base)
            else:
                raise ValueError(f"lora.target: {target} is a {getattr(base, '__name__', base)!r}, which takes no "
                                 "adapter; adapters go on megatron-core's ColumnParallelLinear / RowParallelLinear "
                                 "(the local layer spec, experts as SequentialMLP)")
            setattr(owner, target, ModuleSpec(module=wrapped, params={"lora": settings}))


def lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every LoRA layer of ``model`` (any wrapping), in module order."""
    for name, module in model.named_modules():
        if isinstance(module, _LoraMixin):
            yield name, module


def _adapter_names(model: torch.nn.Module) -> set[str]:
    return {f"{name}.{factor}" for name, _ in lora_layers(model) for factor in ("lora_A", "lora_B")}


def adapter_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """``{name: parameter}`` of the adapters' ``lora_A`` / ``lora_B`` factors."""
    names = _adapter_names(model)
    return {name: p for name, p in model.named_parameters() if name in names}


def base_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """``{name: parameter}`` of everything but the adapters (the HF mapping's domain)."""
    names = _adapter_names(model)
    return {name: p for name, p in model.named_parameters() if name not in names}


class _MergedWeights(Mapping):
    """``base_parameters(model)`` whose LoRA layers' ``weight`` entries read as merged weights, each
    merged when it is read (one layer's extra copy at a time).
    """

    def __init__(self, model: torch.nn.Module):
        self._params = base_parameters(model)
        self._merged = {f"{name}.weight": module for name, module in lora_layers(model)}

    def __getitem__(self, name: str) -> torch.Tensor:
        module = self._merged.get(name)
        return self._params[name] if module is None else module.merged_weight()

    def __iter__(self):
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


def merged_parameters(model: torch.nn.Module) -> Mapping[str, torch.Tensor]:
    """``model``'s parameters by name, as a model without adapters has them: each LoRA layer's
    ``weight`` reads as its merged shard ``W_t + (alpha / r) B_t A_t`` (float32, cast once), the
    adapter factors are left out. A model without adapters reads as ``named_parameters()``.
    """
    return _MergedWeights(model)


@contextmanager
def adapters_disabled(model: torch.nn.Module):
    """Within the block ``model`` computes as its base model (every adapter off); a model without
    adapters is unchanged. The reference of a KL term under LoRA is the policy read this way.
    """
    layers = [module for _, module in lora_layers(model)]
    for module in layers:
        module.adapters_enabled = False
    try:
        yield model
    finally:
        for module in layers:
            module.adapters_enabled = True


def _stable_seed(seed: int, key: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63)


def _layout_free_name(name: str, ep_rank: int, local_experts: int) -> str:
    """A LoRA layer's name within its decoder layer with a local expert ``local_experts.{i}`` renamed
    to its global expert ``experts.{ep_rank * local_experts + i}``: the same on every EP layout.
    """
    marker = "experts.local_experts."
    if marker not in name:
        return name
    head, tail = name.split(marker, 1)
    index, rest = tail.split(".", 1)
    return f"{head}experts.{global_expert(int(index), ep_rank, local_experts)}.{rest}"


def initialize_adapters(gpt: torch.nn.Module, seed: int, tp_rank: int, tp_size: int, ep_rank: int = 0) -> None:
    """Draws every ``A`` and zeroes every ``B`` of the unwrapped ``GPTModel`` stage ``gpt``, the same
    whatever the parallel layout: ``A`` of global layer ``l``'s module ``m`` (an expert's named by its
    global expert index) is drawn whole on the CPU from ``(seed, l, m)``, U(-1/sqrt(in), 1/sqrt(in))
    (``torch.nn.Linear``'s and ``peft``'s Kaiming-uniform init with a = sqrt(5)), then this rank keeps
    its column slice (row-parallel layers).

    Args:
        gpt: the stage (not wrapped).
        seed: the run's seed (``trainer.seed``).
        tp_rank: this rank's tensor-parallel rank (= its expert-TP rank: expert TP = TP).
        tp_size: the tensor-parallel size.
        ep_rank: this rank's expert-parallel rank (0 for dense models).
    """
    with torch.no_grad():
        for layer in gpt.decoder.layers:
            experts = getattr(getattr(layer.mlp, "experts", None), "num_local_experts", 0)
            for name, module in lora_layers(layer):
                rank, width = module.lora_A.shape
                whole = width * tp_size if module._row_parallel else width
                key = f"{layer.layer_number - 1}.{_layout_free_name(name, ep_rank, experts)}"
                generator = torch.Generator().manual_seed(_stable_seed(seed, key))
                bound = 1.0 / math.sqrt(whole)
                drawn = torch.empty(rank, whole, dtype=torch.float64).uniform_(-bound, bound, generator=generator)
                if module._row_parallel:
                    drawn = drawn[:, tp_rank * width:(tp_rank + 1) * width]
                module.lora_A.copy_(drawn)
                module.lora_B.zero_()
