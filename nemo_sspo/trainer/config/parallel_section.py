"""``parallel``: the Megatron layout and the micro-batch shape, with the section's own invariants."""

from __future__ import annotations

from dataclasses import dataclass

from nemo_sspo.algorithms.micro_batches import MicroBatchLayout
from nemo_sspo.megatron.model import Recompute, RecomputeMethod, recompute_kwargs
from nemo_sspo.trainer.config.keyed import failed, problems_at_key

__all__ = ["ParallelConfig", "micro_batch_layout"]


@dataclass
class ParallelConfig:
    """``parallel``: the Megatron layout and the micro-batch shape."""

    tensor_model_parallel_size: int = 1
    """TP: splits attention heads, MLP and the vocabulary; must divide query and key/value heads."""
    pipeline_model_parallel_size: int = 1
    """PP: splits the layers into stages; must divide the layer count."""
    expert_model_parallel_size: int = 1
    """EP (mixture-of-experts models only): splits each MoE layer's experts over this many
    data-parallel replicas (Megatron carves the EP ranks out of DP); must divide the data-parallel
    size and the expert count."""
    micro_batch_size: int = 4
    """Responses per forward/backward pass; a mini-batch is split into micro-batches (grad accumulation).
    Read when ``max_tokens_per_micro_batch`` is null."""
    max_tokens_per_micro_batch: int | None = None
    """Token budget per micro-batch instead of a fixed row count: rows grouped by length, each
    micro-batch padded only to its own longest row (``nemo_sspo.algorithms.micro_batches``); with
    ``pack_sequences`` the width of the one packed row. Must fit the longest prompt + response.
    Under data parallelism each mini-batch's rows are first balanced by tokens across the ranks,
    every rank keeping its row count (``nemo_sspo.parallel.data_balance``)."""
    pack_sequences: bool = False
    """Lay several (prompt, response) sequences end to end in one row per micro-batch, attention
    confined to each; needs ``max_tokens_per_micro_batch``. GPU: TransformerEngine spec only (Megatron's
    THD layout, ``nemo_sspo.megatron.packed_seq``); CPU: the local spec with a block-diagonal mask."""
    output_chunk_size: int | None = 128
    """Fused output layer: log-probs and entropies from the final hidden states and the output
    weight's vocab shard, this many response tokens at a time, so the full logits never exist;
    null lets Megatron's output layer compute logits at every position."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (needs TP > 1): the activations outside the tensor-parallel
    regions (norms, residuals, dropout) are split along the sequence over the TP ranks, dividing
    their memory by TP; required for mixture-of-experts layers under TP > 1. Each micro-batch's
    width is padded to a multiple of TP (``nemo_sspo.megatron.sequence_parallel``)."""
    context_parallel_size: int = 1
    """CP: splits every sequence over this many ranks (Megatron's load-balanced split, two chunks
    per rank). The attention needs TransformerEngine (GPU); the loss side runs everywhere."""
    recompute: Recompute = Recompute.none
    """Activation recomputation (Megatron's ``recompute_granularity``): ``none``, ``selective``
    (recompute the core attention, keep the rest) or ``full`` (keep each recomputed layer's input
    only; ``recompute_method`` and ``recompute_num_layers`` say which layers)."""
    recompute_method: RecomputeMethod = RecomputeMethod.uniform
    """``recompute: full`` only: ``uniform`` recomputes every layer in chunks of
    ``recompute_num_layers`` layers; ``block`` recomputes the first ``recompute_num_layers`` layers of
    each pipeline stage and keeps the others' activations."""
    recompute_num_layers: int = 1
    """``recompute: full`` only: layers per recomputed chunk (``uniform``) or recomputed layers per
    pipeline stage (``block``)."""

    def problems(self, key: str) -> list[str]:
        """The section's own invariants: sizes, the micro-batch layout, recomputation, sequence parallelism.

        Args:
            key: the section's key path.

        Returns:
            One message per broken invariant, naming ``key.<field>`` and the fix.
        """
        cp = self.context_parallel_size
        return [
            *failed(
                (self.tensor_model_parallel_size >= 1 and self.pipeline_model_parallel_size >= 1,
                 f"{key}.tensor_model_parallel_size and {key}.pipeline_model_parallel_size must be >= 1"),
                (isinstance(cp, int) and cp >= 1,
                 f"{key}.context_parallel_size={cp!r} must be an integer >= 1 (1 = no context parallelism)"),
                (self.output_chunk_size is None or self.output_chunk_size >= 1,
                 f"{key}.output_chunk_size must be >= 1, or null for Megatron's output layer"),
                (not (isinstance(cp, int) and cp > 1) or not self.pack_sequences,
                 f"{key}.context_parallel_size={cp} with {key}.pack_sequences=true is not supported: packed "
                 "(THD) rows need a split per sequence (TransformerEngine's thd_get_partitioned_indices), not the "
                 f"per-row split used here; set {key}.pack_sequences=false or {key}.context_parallel_size=1"),
                (not self.sequence_parallel or self.tensor_model_parallel_size > 1,
                 f"{key}.sequence_parallel=true needs {key}.tensor_model_parallel_size > 1 (it splits the "
                 f"sequence over the tensor-parallel ranks); set {key}.sequence_parallel=false or raise "
                 f"{key}.tensor_model_parallel_size"),
            ),
            *problems_at_key("", lambda: micro_batch_layout(self)),
            *self.recompute_problems(key),
        ]

    def recompute_problems(self, key: str, layers_per_stage: int | None = None) -> list[str]:
        """``recompute`` with its method and layer count.

        Args:
            key: the section's key path.
            layers_per_stage: the model's decoder layers per pipeline stage, once its config is known
                (bounds ``recompute_num_layers``); None before.

        Returns:
            One message per broken invariant.
        """
        defaults = ParallelConfig()
        return [
            *failed(*(  # a setting that would be ignored is refused
                (self.recompute == "full" or getattr(self, name) == getattr(defaults, name),
                 f"{key}.{name}={getattr(self, name)!r} acts only with {key}.recompute=full (it is "
                 f"{self.recompute!r}): set {key}.recompute=full, or leave {name} out")
                for name in ("recompute_method", "recompute_num_layers"))),
            *problems_at_key(f"{key}.", lambda: recompute_kwargs(
                self.recompute, self.recompute_method, self.recompute_num_layers,
                layers_per_stage=layers_per_stage or max(self.recompute_num_layers, 1))),
        ]


def micro_batch_layout(par: ParallelConfig) -> MicroBatchLayout:
    """The policy's micro-batch layout from ``parallel.*`` (errors name the key).

    Args:
        par: the ``parallel`` section.

    Returns:
        The layout the loop splits mini-batches with.

    Raises:
        ValueError: a size below 1, or ``pack_sequences`` without ``max_tokens_per_micro_batch``.
    """
    if par.pack_sequences and par.max_tokens_per_micro_batch is None:
        raise ValueError("parallel.pack_sequences=true needs parallel.max_tokens_per_micro_batch (the "
                         "packed row's width, at least the longest prompt + response)")
    for name in ("micro_batch_size", "max_tokens_per_micro_batch"):
        value = getattr(par, name)
        if value is not None and value < 1:
            raise ValueError(f"parallel.{name}={value} must be >= 1")
    fixed = par.max_tokens_per_micro_batch is None
    return MicroBatchLayout(micro_batch_size=par.micro_batch_size if fixed else None,
                            max_tokens=par.max_tokens_per_micro_batch, pack=par.pack_sequences)
