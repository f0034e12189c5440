"""The policy's weights as Hugging Face buckets for a refit: the one object a rollout source draws them from.

A rollout source (:mod:`nemo_sspo.rollouts`) holds a :class:`WeightExporter` and calls
:meth:`WeightExporter.buckets` after each update; it never receives the trainer or a closure of it.
What a bucket holds and which ranks must iterate is :func:`nemo_sspo.megatron.hf_mapping.iter_hf_weight_buckets`.
A variant export (e.g. adapters merged into the base weights) is another exporter with the same method.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from nemo_sspo.megatron.hf_mapping import iter_hf_weight_buckets

__all__ = ["WeightExporter"]


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
