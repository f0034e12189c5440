"""Megatron's sequence parallelism (``parallel.sequence_parallel``) for the local layer spec and the
consumers of the sequence-split activations.

With ``TransformerConfig.sequence_parallel`` and TP > 1, the activations outside the
tensor-parallel regions (embedding output, residual stream, norms, the decoder's output) are
``[S / tp, B, H]`` on each TP rank: rank ``r`` holds sequence positions ``[r * S / tp, (r + 1) * S / tp)``
(megatron-core 0.16.1: ``LanguageModelEmbedding`` scatters along the first dimension,
``ColumnParallelLinear`` all-gathers its input and ``RowParallelLinear`` reduce-scatters its
output). What megatron-core leaves to us, and where it is done:

- The norms of the local spec: megatron-core's ``WrappedTorchNorm`` asserts
  ``not config.sequence_parallel``. :class:`SequenceParallelTorchNorm` is the same torch
  ``RMSNorm`` / ``LayerNorm`` with ``weight.sequence_parallel = config.sequence_parallel``: each
  TP rank's norm weight then sees only its own positions, and ``finalize_model_grads``
  (``_allreduce_non_tensor_model_parallel_grads``) sums the gradients of parameters carrying that
  attribute over the TP group, as for TransformerEngine's ``TENorm`` and the MoE router.
- The sequence length: every micro-batch's width must split over TP. :func:`sequence_parallel_size`
  is the multiple ``nemo_sspo.megatron.model.forward_logits`` pads a row to (right padding with
  token 0; attention is causal, so no real position sees it, and the output is cut back).
- The fused output layer and the critic's value head read the final hidden states, which are
  sequence-split: :func:`gather_sequence` all-gathers them (backward: this rank's slice of a
  gradient that is already complete on every TP rank, see there).
- MoE routers see this rank's positions only (``[S / tp * B]`` tokens, sequence-first): router
  replay sends each rank its slice of the routes (:func:`sequence_slice`) and gathers the
  recorded ones (:func:`gather_sequence`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["SequenceParallelTorchNorm", "gather_sequence", "sequence_parallel_size", "sequence_slice"]


class SequenceParallelTorchNorm:
    """torch ``RMSNorm`` / ``LayerNorm`` for the local spec that also runs under sequence parallelism.

    Same constructor as megatron-core 0.16.1's ``WrappedTorchNorm`` (``transformer/torch_norm.py``)
    and the same module it builds (``torch.nn.RMSNorm(hidden_size, eps)`` for
    ``config.normalization == "RMSNorm"``, ``torch.nn.LayerNorm`` otherwise; weights and state-dict
    keys unchanged), without its ``sequence_parallel`` refusal: the weight (and bias) get the
    attribute ``sequence_parallel = config.sequence_parallel``, so ``finalize_model_grads``
    all-reduces their gradients over the TP group when it is set (module docstring). Input
    ``[S / tp, B, H]`` (or any ``[..., H]``), output the same shape and dtype.

    Raises:
        ValueError: ``layernorm_zero_centered_gamma``, ``persist_layer_norm``,
            ``memory_efficient_layer_norm`` (options torch's norms do not have), or a normalization
            other than ``RMSNorm`` / ``LayerNorm``.
    """

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm") -> torch.nn.Module:
        """The norm module (class docstring); ``normalization`` and the two flags are unused, as in
        megatron-core's ``WrappedTorchNorm`` (the config decides).
        """
        for option in ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm"):
            if getattr(config, option, False):
                raise ValueError(f"TransformerConfig.{option}=True is not supported by the local spec's torch norms")
        kinds = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}
        if config.normalization not in kinds:
            raise ValueError(f"TransformerConfig.normalization={config.normalization!r}: the local spec's "
                             f"norms support {', '.join(kinds)}")
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm


def sequence_parallel_size(config: Any) -> int:
    """TP size when ``config.sequence_parallel`` is set (the sequence is split that many ways), else 1:
    the multiple every micro-batch's width is padded to under ``config`` (a ``TransformerConfig``).
    """
    return config.tensor_model_parallel_size if getattr(config, "sequence_parallel", False) else 1


def gather_sequence(tensor: torch.Tensor, config: Any) -> torch.Tensor:
    """This rank's sequence shard ``[S / tp, ...]`` all-gathered over TP to ``[S, ...]``.

    Megatron's ``tensor_parallel.gather_from_sequence_parallel_region`` with
    ``tensor_parallel_output_grad=False``: its backward keeps this rank's ``S / tp`` rows of the
    incoming gradient (no communication). That is right for the consumers here, whose gradient
    w.r.t. the gathered tensor is already complete and equal on every TP rank: the fused output
    layer all-reduces ``dL/dh`` over TP itself (:mod:`nemo_sspo.parallel.fused_output`), the critic's
    value head and the MoE auxiliary loss are replicated. (A reduce-scatter there would count each
    rank's contribution ``tp`` times.) Integer tensors (recorded routes) are gathered without grad.
    Without sequence parallelism ``tensor`` is returned as is.
    """
    if sequence_parallel_size(config) == 1:
        return tensor
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    if not tensor.is_floating_point():
        with torch.no_grad():
            return gather_from_sequence_parallel_region(tensor, tensor_parallel_output_grad=False)
    return gather_from_sequence_parallel_region(tensor, tensor_parallel_output_grad=False)


def sequence_slice(length: int, config: Any) -> slice:
    """The positions ``[r * length / tp, (r + 1) * length / tp)`` this TP rank holds of a sequence
    of ``length`` (padded: divisible by :func:`sequence_parallel_size`); all of it without sequence
    parallelism.

    Raises:
        ValueError: ``length`` not divisible by the sequence-parallel size.
    """
    size = sequence_parallel_size(config)
    if size == 1:
        return slice(0, length)
    if length % size:
        raise ValueError(f"sequence of {length} positions does not split over {size} sequence-parallel ranks")
    from megatron.core import parallel_state

    shard = length // size
    rank = parallel_state.get_tensor_model_parallel_rank()
    return slice(rank * shard, (rank + 1) * shard)
