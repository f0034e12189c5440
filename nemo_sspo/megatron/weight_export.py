"""The policy's weights as Hugging Face buckets for a refit: the one object a rollout source draws them from.

A rollout source (:mod:`nemo_sspo.rollouts`) holds a :class:`WeightExporter` and calls
:meth:`WeightExporter.buckets` after each update; it never receives the trainer or a closure of it.
What a bucket holds and which ranks must iterate is :func:`nemo_sspo.megatron.hf_mapping.iter_hf_weight_buckets`.
Under LoRA both export the policy as it computes: :class:`WeightExporter` every weight with the
adapters merged into it, :class:`AdapterExporter` the adapters alone (for an engine that applies them
to the base weights it loaded).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from nemo_sspo.megatron.hf_mapping import export_hf_adapters, iter_hf_weight_buckets

__all__ = ["AdapterExporter", "WeightExporter"]


class WeightExporter:
    """Streams one model stage's current weights as HF buckets, gathered on one rank of its replica.

    Args:
        model: this rank's Megatron GPTModel stage (unwrapped or DDP-wrapped); read at each call, so
            the buckets hold the weights of that moment.
        hf_config: its HF config.
        bucket_bytes: bucket budget in bytes (``rollout.refit.bucket_mb`` * 2**20), > 0.
        dst_rank: the global rank the buckets are gathered on (the replica's generating or export
            rank); None: the model-parallel group's first rank.
    """

    def __init__(self, model: torch.nn.Module, hf_config: Any, *, bucket_bytes: int,
                 dst_rank: int | None) -> None:  # noqa: D107 - documented on the class
        self.model, self.hf_config, self.bucket_bytes, self.dst_rank = model, hf_config, bucket_bytes, dst_rank

    def buckets(self) -> Iterator[dict[str, torch.Tensor]]:
        """The weights now, bucket by bucket (collective over the replica's model-parallel ranks: each
        must iterate to the end; buckets are yielded on ``dst_rank`` only).

        Raises:
            ValueError: as :func:`~nemo_sspo.megatron.hf_mapping.iter_hf_weight_buckets`, when iterated
                (``bucket_bytes <= 0``, ``dst_rank`` outside the model-parallel group).
        """
        return iter_hf_weight_buckets(self.model, self.hf_config, self.bucket_bytes, dst_rank=self.dst_rank)


class AdapterExporter:
    """Streams a LoRA policy's adapters, gathered on one rank of its replica, as one bucket: the
    ``peft`` library's names without its prefix (``model.layers.{l}.self_attn.q_proj.lora_A.weight``
    [r, in], ``...lora_B.weight`` [out, r]; :func:`~nemo_sspo.megatron.hf_mapping.export_hf_adapters`),
    with every ``lora_B`` multiplied by ``alpha / r``, so an engine applies them at scale 1 on the
    base weights it holds: ``W + lora_B @ lora_A``.

    Args:
        model: this rank's Megatron GPTModel stage with adapters (any wrapping); read at each call.
        hf_config: its HF config.
        scaling: ``alpha / r`` (``model.lora``).
        dst_rank: as :class:`WeightExporter`.
    """

    def __init__(self, model: torch.nn.Module, hf_config: Any, *, scaling: float,
                 dst_rank: int | None) -> None:  # noqa: D107 - documented on the class
        self.model, self.hf_config, self.scaling, self.dst_rank = model, hf_config, scaling, dst_rank

    def buckets(self) -> Iterator[dict[str, torch.Tensor]]:
        """The adapters now, as one bucket on ``dst_rank`` (collective over the replica's model-parallel
        ranks, each of which must iterate to the end; nothing is yielded on the others).
        """
        adapters = export_hf_adapters(self.model, self.hf_config, dst_rank=self.dst_rank)
        if adapters:
            yield {name: tensor * self.scaling if name.endswith("lora_B.weight") else tensor
                   for name, tensor in adapters.items()}
