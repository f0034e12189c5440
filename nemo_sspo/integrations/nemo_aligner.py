"""NeMo-Aligner adapter: a nemo_sspo policy loss as the ``loss_func`` of its Megatron actor.

NeMo-Aligner is deprecated (NVIDIA moved post-training to NeMo-RL: use
:mod:`nemo_sspo.integrations.nemo_rl`), and its last release, 0.7.0 (PyPI ``nemo-aligner``), has
no GRPO: it trains with PPO (``MegatronGPTActorModel``, critic advantages) and REINFORCE
(``MegatronGPTReinforceActorModel``, RLOO baseline). GRPO lived only on an unreleased branch
(NVIDIA/NeMo-Aligner ``geshen/llama_combo``, last commit 7b3805a, 2024-12-01), whose trainer
broadcasts A_i over the response and reuses the PPO actor. ``tools/record_nemo_aligner.py`` ran
these actors' own losses (NeMo toolkit, Lightning and TensorRT-LLM stood in for, Megatron-Core
real) and ``tests/integration/test_nemo_aligner_recorded.py`` checks this adapter against them.

Host contract (the actor's ``fwd_output_and_loss_func``): on the last pipeline stage
``parallel_logits = model(response_tokens, position_ids, attention_mask, labels=None)`` is
``[B, S, V_local]`` (vocab-sharded over tensor parallelism), and ``loss_func(parallel_logits)``
returns ``(loss, metrics)``; ``loss`` is the mean over this micro-batch (Megatron's schedule
averages micro-batches, DDP averages data-parallel ranks) and each metric a 0-d tensor already
averaged over the data-parallel group. Batch keys: ``response_tokens`` [B, S] int64 (prompt +
response), ``mask`` [B, S - 1] (response targets), ``is_end`` [B] (responses that ended properly;
others are masked out of the loss, as the PPO actor does), and, by ``advantage_layout``:

- "tokens" (the GRPO branch's batch): ``advantages`` [B, S - 1] holding A_i at every response
  token, ``prev_logprobs`` [B, S - 1];
- "last_token": the same keys, A_i at the last response token only;
- "gae" (0.7.0's PPO batch): ``advantages`` are per-token GAE estimates from the critic
  (``values`` and ``returns`` are present and not read). Only a loss whose ratio unit is the
  token and whose aggregation is "token-mean" (GRPO, DAPO, CISPO) is defined for them: each token
  is then its own row, which is the PPO actor's token mean exactly;
- "reinforce" (0.7.0's REINFORCE batch): ``rewards_with_kl`` and ``baseline`` [B, 1], A_i their
  difference. The batch has no ``prev_logprobs`` (REINFORCE is on-policy): the old log-probs are
  then the detached current ones, exact on the first optimizer step after a rollout.

``mask_rule`` "grpo_branch" applies the branch actor's token mask instead, ``mask * (advantages !=
0)`` with ``is_end`` not applied: tokens of zero-advantage responses leave the mean's denominator.

Old-policy entropy (SSPO eq. 12): NeMo-Aligner computes none. ``old_entropy_source="current"``
(the default) uses the detached entropy of the logits being trained, which equals the old
policy's on the first optimizer step after each rollout; or store :data:`PREV_ENTROPY_KEY`
[B, S - 1] next to ``prev_logprobs`` with :func:`logprobs_and_entropy` in the actor's log-prob
pass, carry it through the trainer, and use ``"batch"``.

Differences from the host's own loss, by design: log-probs and entropy come from our fused
:func:`nemo_sspo.parallel.vocab_parallel_logprobs_entropy` with explicit groups; padding columns
at or above ``vocab_size`` get probability 0 when ``vocab_size`` is given; metrics are reduced
over data parallelism as (sum, count) pairs, not as a mean of per-rank means; the REINFORCE
actor's own mean keeps unfinished responses (it masks with ``mask`` only), this adapter drops
them as the PPO actor does.
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
from nemo_sspo.parallel.metric_reduce import reduce_metric_sums

__all__ = ["MASK_RULES", "PREV_ENTROPY_KEY", "logprobs_and_entropy", "make_actor_loss_func"]

_REQUIRED_KEYS = {"tokens": ("response_tokens", "mask", "advantages", "prev_logprobs"),
                  "last_token": ("response_tokens", "mask", "advantages", "prev_logprobs"),
                  "gae": ("response_tokens", "mask", "advantages", "prev_logprobs"),
                  "reinforce": ("response_tokens", "mask", "rewards_with_kl", "baseline")}
_PER_RESPONSE = {"tokens": per_response_advantages, "last_token": last_token_advantages}
MASK_RULES = ("release", "grpo_branch")
"""``mask_rule`` values: the 0.7.0 actor's ``mask * is_end``, or the GRPO branch's
``mask * (advantages != 0)``."""


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
    old_entropy_source: str = "current",
    advantage_layout: str = "tokens",
    mask_rule: str = "release",
    max_response_length: int | None = None,
) -> Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """The actor's ``loss_func`` for one micro-batch (module docstring for the contract).

    Return it from ``fwd_output_and_loss_func`` in place of the host's loss:
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
        temperature: divides the logits (the host's actor losses use 1.0).
        old_entropy_source: "current" (detached entropy of ``parallel_logits``) or "batch" (reads
            :data:`PREV_ENTROPY_KEY`); read only by losses that use it (SSPO).
        advantage_layout: "tokens", "last_token", "gae" or "reinforce": which batch this is and
            where each response's advantage sits (module docstring).
        mask_rule: one of :data:`MASK_RULES`: "release" (``mask * is_end``, NeMo-Aligner 0.7.0)
            or "grpo_branch" (``mask * (advantages != 0)``, the unreleased GRPO branch's actor).
        max_response_length: L_max for the "constant-denominator" aggregation.

    Returns:
        ``loss_func(parallel_logits [B, S, V_local]) -> (loss, metrics)``: ``loss`` a 0-d tensor
        (0 with a zero gradient when no token of the micro-batch is valid, as the host does);
        ``metrics`` 0-d float32 tensors on the logits' device: ``loss`` (averaged over
        ``dp_group``) and every metric of the loss reduced over ``dp_group`` (identical on all
        data-parallel ranks). Call it on every data-parallel rank (it runs collectives).

    Raises:
        ValueError: a required batch key is missing, bad ``old_entropy_source``,
            ``advantage_layout`` or ``mask_rule``, unknown loss or wrong config type, a config
            this adapter cannot run (``kl_coef`` or ``entropy_coef`` > 0, "constant-denominator"
            without ``max_response_length``, a text-reading segmentation without ``tables``,
            "gae" with a loss that is not token-unit "token-mean") (all at once, here), or the
            advantage layout's and the loss's own checks (inside ``loss_func``).
    """
    if advantage_layout not in _REQUIRED_KEYS:
        raise ValueError(f"advantage_layout={advantage_layout!r}; valid: {list(_REQUIRED_KEYS)}")
    if mask_rule not in MASK_RULES:
        raise ValueError(f"mask_rule={mask_rule!r}; valid: {list(MASK_RULES)}")
    if mask_rule == "grpo_branch" and advantage_layout == "reinforce":
        raise ValueError("mask_rule='grpo_branch' reads batch['advantages'], which the REINFORCE "
                         "batch (advantage_layout='reinforce') does not have")
    loss = bind_loss(loss_name, loss_config)
    needs = loss.requirements
    required = _REQUIRED_KEYS[advantage_layout]
    check_old_entropy_source(old_entropy_source, batch, required,
                             f"NeMo-Aligner {advantage_layout!r} actor",
                             reads_entropy=needs.old_entropy)
    check_host_config(
        loss, host="NeMo-Aligner", max_response_length=max_response_length, tables=tables,
        kl_hint="NeMo-Aligner's KL penalty (ppo.initial_policy_kl_penalty) is folded into "
                "per-token rewards, which these per-response losses cannot read either: a "
                "reference-KL penalty is not supported with this adapter.",
        entropy_hint="The host's actor entropy bonus is not applied by this loss_func; an "
                     "entropy bonus is not supported with this adapter.")
    if advantage_layout == "gae" and (needs.segmentation != "token"
                                      or loss.config.aggregation != "token-mean"):
        raise ValueError(f"advantage_layout='gae' (PPO's per-token critic advantages) is defined "
                         f"only for token-unit losses with aggregation 'token-mean' (grpo, dapo, "
                         f"cispo); {loss_name!r} has segmentation {needs.segmentation!r} and "
                         f"aggregation {loss.config.aggregation!r}. Train it on a batch with one "
                         "advantage per response (GRPO branch, REINFORCE)")

    def loss_func(parallel_logits: torch.Tensor):
        tokens = batch["response_tokens"]
        mask = _token_mask(batch, mask_rule)
        logprobs, entropy = shifted_logprobs_entropy(
            parallel_logits, tokens, mask, tp_group=tp_group, tp_rank=_tp_rank(tp_group),
            vocab_size=vocab_size, temperature=temperature)
        if needs.old_entropy and old_entropy_source == "batch":
            entropy = old_entropy(old_entropy_source, batch, entropy)
        old_logprobs = (batch["prev_logprobs"] if "prev_logprobs" in batch
                        else logprobs.detach())  # REINFORCE: on-policy
        frame = dict(logprobs=logprobs, old_logprobs=old_logprobs, response_mask=mask,
                     response_ids=tokens[:, 1:], old_entropy=entropy if needs.old_entropy else None)
        if advantage_layout == "gae":  # one row per valid token
            frame = {key: value[mask][:, None] for key, value in frame.items() if value is not None}
            frame.setdefault("old_entropy", None)
            advantages = batch["advantages"][mask]
        elif advantage_layout == "reinforce":
            advantages = (batch["rewards_with_kl"] - batch["baseline"]).reshape(-1)
        else:
            advantages = _PER_RESPONSE[advantage_layout](batch["advantages"], mask)
        numerator, denominator, metrics = host_loss_sums(
            loss, advantages=advantages, tables=tables, max_response_length=max_response_length,
            **frame)
        value = torch.where(denominator > 0, numerator / denominator.clamp(min=1),
                            parallel_logits.sum() * 0)
        return value, _reduced_metrics(value, metrics, dp_group)

    return loss_func


def _token_mask(batch, mask_rule: str) -> torch.Tensor:
    """``[B, S - 1]`` bool tokens that enter the loss under ``mask_rule``."""
    mask = batch["mask"].bool()
    if mask_rule == "grpo_branch":
        return mask & (batch["advantages"] != 0)
    if batch.get("is_end") is not None:
        mask = mask & batch["is_end"].bool().reshape(-1)[:, None]
    return mask


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
