"""NeMo-Aligner adapter: a nemo_sspo policy loss as the ``loss_func`` of its Megatron actor.

Written against NeMo-Aligner 0.7.0 (PyPI ``nemo-aligner``; ``MegatronGPTActorModel`` in
``nemo_aligner/models/nlp/gpt/megatron_gpt_ppo_actor.py``), whose actor also serves the GRPO
trainer of the experimental GRPO branch (``nemo_aligner/algorithms/grpo.py``). NeMo-Aligner needs
NeMo 2.x-era containers (NeMo toolkit's ``nemo.collections.nlp``, Apex, TransformerEngine), none
of which install on these CPU machines, so this module was exercised by calling it as the actor
calls ``loss_func``, not inside NeMo-Aligner.

Host contract (the actor's ``fwd_output_and_loss_func``): on the last pipeline stage
``parallel_logits = model(response_tokens, position_ids, attention_mask, labels=None)`` is
``[B, S, V_local]`` (vocab-sharded over tensor parallelism), and ``loss_func(parallel_logits)``
returns ``(loss, metrics)``; ``loss`` is the mean over this micro-batch (Megatron's schedule
averages micro-batches, DDP averages data-parallel ranks) and each metric a 0-d tensor already
averaged over the data-parallel group; ``get_loss_and_metrics`` then averages the metrics over
micro-batches and broadcasts them from the last rank. Batch keys: ``response_tokens`` [B, S]
int64 (prompt + response), ``mask`` [B, S - 1] (response targets), ``advantages`` [B, S - 1],
``prev_logprobs`` [B, S - 1], ``is_end`` [B] (responses that ended properly; others are masked out
of the loss), plus the old policy's token entropy, which NeMo-Aligner does not compute. Either
store it as :data:`PREV_ENTROPY_KEY` [B, S - 1] next to ``prev_logprobs`` (compute both with
:func:`logprobs_and_entropy` in the actor's log-prob pass and carry the key through the trainer's
``generate_ppo_data``), or use ``old_entropy_source="current"``: the detached entropy of the logits
being trained, which equals the old policy's on the first optimizer step after each rollout (so
always, when the GRPO config takes one optimizer step per rollout batch).

Differences from the host's own loss, by design: log-probs and entropy come from our fused
:func:`nemo_sspo.parallel.vocab_parallel_logprobs_entropy` with explicit groups; padding columns
at or above ``vocab_size`` get probability 0 when ``vocab_size`` is given; metrics are reduced
over data parallelism as (sum, count) pairs, not as a mean of per-rank means.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from nemo_sspo.algorithms.segmentation import SegmentTables
from nemo_sspo.integrations._common import (
    PREV_ENTROPY_KEY,
    bind_loss,
    check_host_config,
    check_old_entropy_source,
    host_loss_sums,
    last_token_advantages,
    old_entropy,
    per_response_advantages,
    shifted_logprobs_entropy,
)
from nemo_sspo.parallel.metrics import reduce_metric_sums

__all__ = ["PREV_ENTROPY_KEY", "logprobs_and_entropy", "make_actor_loss_func"]

_REQUIRED_KEYS = ("response_tokens", "mask", "advantages", "prev_logprobs")
_ADVANTAGE_LAYOUTS = {"tokens": per_response_advantages, "last_token": last_token_advantages}


def _tp_rank(tp_group) -> int:
    return 0 if tp_group is None else dist.get_rank(tp_group)


def logprobs_and_entropy(parallel_logits: torch.Tensor, tokens: torch.Tensor, *, tp_group,
                         vocab_size: int | None = None, temperature: float = 1.0,
                         mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Old-policy ``prev_logprobs`` and :data:`PREV_ENTROPY_KEY` ``[B, S - 1]`` from actor logits.

    A drop-in for the actor's ``from_parallel_logits_to_logprobs(parallel_logits, tokens)`` in its
    log-prob pass (``get_logprob_output_only_func``), returning the entropy too.

    Args:
        parallel_logits: ``[B, S, V_local]`` vocab shard of this tensor-parallel rank.
        tokens: ``[B, S]`` int64 ``response_tokens``.
        tp_group: tensor-parallel group (``parallel_state.get_tensor_model_parallel_group()``), or
            None for one rank holding the whole vocabulary.
        vocab_size: true vocabulary size (drops Megatron's padding rows); None counts every column,
            as NeMo-Aligner's ``from_parallel_logits_to_logprobs`` does.
        temperature: divides the logits; use the value the training loss uses (the actor's own
            loss uses the raw logits, i.e. 1.0).
        mask: ``[B, S - 1]`` bool positions to compute (default all; others are 0).

    Returns:
        ``(logprobs, entropy)`` ``[B, S - 1]`` float32 (fp64 for fp64 logits); entropy detached.
    """
    if mask is None:
        mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1, dtype=torch.bool,
                          device=tokens.device)
    return shifted_logprobs_entropy(parallel_logits, tokens, mask.bool(), tp_group=tp_group,
                                    tp_rank=_tp_rank(tp_group), vocab_size=vocab_size,
                                    temperature=temperature)


def make_actor_loss_func(
    batch: Mapping[str, torch.Tensor],
    *,
    loss_name: str = "sspo",
    loss_config: Any | None = None,
    tables: SegmentTables | None = None,
    tp_group,
    dp_group,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    old_entropy_source: str = "batch",
    advantage_layout: str = "tokens",
    max_response_length: int | None = None,
) -> Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """The actor's ``loss_func`` for one micro-batch (module docstring for the contract).

    Return it from ``fwd_output_and_loss_func`` in place of the PPO loss:
    ``return parallel_logits, make_actor_loss_func(batch, tp_group=..., dp_group=..., ...)``.

    Args:
        batch: the micro-batch dict on the last pipeline stage (keys in the module docstring;
            ``is_end`` optional).
        loss_name: a registered nemo_sspo loss (default "sspo").
        loss_config: its config instance or a mapping of its fields; None uses the defaults. Its
            ``aggregation`` reduces the micro-batch.
        tables: ``build_segment_tables(tokenizer)``, for segmentations that read token texts.
        tp_group: tensor-parallel group of the logits shard (None: full vocabulary here).
        dp_group: data-parallel group over which metrics are reduced (None: no reduction).
        vocab_size: true vocabulary size; None counts every logits column (the host's behaviour).
        temperature: divides the logits (the host's PPO loss uses 1.0).
        old_entropy_source: "batch" reads :data:`PREV_ENTROPY_KEY`; "current" uses the detached
            entropy of ``parallel_logits`` (module docstring for when that is exact).
        advantage_layout: how ``batch["advantages"]`` holds each response's advantage A_i:
            "tokens" (at every response token, as GRPO trainers broadcast it) or "last_token"
            (at the last response token, zeros elsewhere, as NeMo-Aligner's
            ``calculate_ppo_rewards`` places a scalar reward).
        max_response_length: L_max for the "constant-denominator" aggregation.

    Returns:
        ``loss_func(parallel_logits [B, S, V_local]) -> (loss, metrics)``: ``loss`` a 0-d tensor
        (0 with a zero gradient when no token of the micro-batch is valid, as the host does);
        ``metrics`` 0-d float32 tensors on the logits' device: ``loss`` (averaged over
        ``dp_group``) and every metric of the loss reduced over ``dp_group`` (identical on all
        data-parallel ranks). Call it on every data-parallel rank (it runs collectives).

    Raises:
        ValueError: a required batch key is missing, bad ``old_entropy_source`` or
            ``advantage_layout``, unknown loss or wrong config type, a config this adapter cannot
            run (``kl_coef`` or ``entropy_coef`` > 0, "constant-denominator" without
            ``max_response_length``, a text-reading segmentation without ``tables``) (all at
            once, here), or the
            advantage layout's and the loss's own checks (inside ``loss_func``).
    """
    if advantage_layout not in _ADVANTAGE_LAYOUTS:
        raise ValueError(f"advantage_layout={advantage_layout!r}; valid: "
                         f"{list(_ADVANTAGE_LAYOUTS)}")
    to_response_advantages = _ADVANTAGE_LAYOUTS[advantage_layout]
    check_old_entropy_source(old_entropy_source, batch, _REQUIRED_KEYS, "NeMo-Aligner actor")
    loss = bind_loss(loss_name, loss_config)
    check_host_config(
        loss, host="NeMo-Aligner", max_response_length=max_response_length, tables=tables,
        kl_hint="NeMo-Aligner's KL penalty (ppo.initial_policy_kl_penalty) is folded into "
                "per-token rewards, which these per-response losses cannot read either: a "
                "reference-KL penalty is not supported with this adapter.",
        entropy_hint="The host's actor entropy bonus is not applied by this loss_func; an "
                     "entropy bonus is not supported with this adapter.")

    def loss_func(parallel_logits: torch.Tensor):
        tokens = batch["response_tokens"]
        mask = batch["mask"].bool()
        if batch.get("is_end") is not None:
            mask = mask & batch["is_end"].bool()[:, None]
        logprobs, entropy = shifted_logprobs_entropy(
            parallel_logits, tokens, mask, tp_group=tp_group, tp_rank=_tp_rank(tp_group),
            vocab_size=vocab_size, temperature=temperature)
        numerator, denominator, metrics = host_loss_sums(
            loss, logprobs=logprobs, old_logprobs=batch["prev_logprobs"],
            advantages=to_response_advantages(batch["advantages"], mask), response_mask=mask,
            response_ids=tokens[:, 1:], old_entropy=old_entropy(old_entropy_source, batch, entropy),
            tables=tables, max_response_length=max_response_length)
        value = torch.where(denominator > 0, numerator / denominator.clamp(min=1), numerator * 0)
        return value, _reduced_metrics(value, metrics, dp_group)

    return loss_func


def _reduced_metrics(loss: torch.Tensor, metrics: dict[str, torch.Tensor], dp_group) -> dict:
    """Metrics as the actor returns them: 0-d tensors, reduced over the data-parallel group."""
    values = reduce_metric_sums(metrics, dp_group=dp_group, pp_group=None, last_stage_rank=0,
                                is_last_stage=True)
    reduced_loss = loss.detach().clone().to(torch.float32)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(reduced_loss, group=dp_group)
        reduced_loss /= dist.get_world_size(dp_group)
    device = loss.device
    out = {"loss": reduced_loss}
    out.update({k: torch.tensor(v, dtype=torch.float32, device=device) for k, v in values.items()})
    return out
