"""Pieces every host adapter shares.

Host imports, per-response advantages, segment ids from token ids, the bound loss of a registered
name, the old-entropy source, and the one per-micro-batch path (:func:`host_loss_sums`, i.e.
``nemo_sspo.algorithms.losses.policy_loss_sums``).

No loss maths lives here. Old-policy entropy, in every adapter: ``old_entropy_source="batch"``
reads the host batch's :data:`PREV_ENTROPY_KEY`, a tensor aligned exactly like that host's
``prev_logprobs`` (the same shape and columns); ``"current"`` uses the detached entropy of the
logits being trained, equal to the old policy's only on the first optimizer step after a rollout.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import fields
from types import ModuleType
from typing import Any

import torch

from nemo_sspo.algorithms.losses import (
    LossInputs,
    build_policy_loss_config,
    get_policy_loss,
    make_policy_loss,
    policy_loss_sums,
)
from nemo_sspo.algorithms.losses.loss_registry import BoundPolicyLoss
from nemo_sspo.algorithms.segmentation import (
    TABLE_FREE_SEGMENTATIONS,
    SegmentTables,
    segment_ids,
)
from nemo_sspo.metrics import MetricPair

PREV_ENTROPY_KEY = "prev_entropy"
"""Host batch key: old-policy token entropy (nats), aligned exactly like the host's
``prev_logprobs`` (module docstring)."""
OLD_ENTROPY_SOURCES = ("batch", "current")

# Relative tolerance of the "one advantage per response" check (float32 broadcasts are exact, so
# any real spread is a token-level advantage such as GAE, orders of magnitude above this).
_ADVANTAGE_RTOL = 1e-5


def import_host(module: str, host: str, how_to_install: str) -> ModuleType:
    """Import ``module`` of a host training loop, or explain how to get it.

    Raises:
        ImportError: naming the host, the missing module and ``how_to_install``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"{host} is needed for this adapter but `import {module}` failed ({error}). "
            f"{how_to_install}"
        ) from error


def per_response_advantages(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Collapse token-level advantages ``[B, T]`` to one advantage per response ``[B]``.

    GRPO-style hosts broadcast the response's advantage A_i to its tokens; the segment-ratio losses
    need A_i itself. Rows without a valid token get 0.

    Args:
        advantages: ``[B, T]`` float, the same value at every valid token of a row.
        response_mask: ``[B, T]`` bool, valid tokens.

    Returns:
        ``[B]`` float32 (fp64 for fp64 input), the masked row mean.

    Raises:
        ValueError: shapes differ, or a row's valid advantages differ (a token-level estimator such
            as GAE: these losses need an outcome advantage per response, e.g. GRPO/RLOO). The check
            costs one device-to-host sync.
    """
    if advantages.shape != response_mask.shape or advantages.dim() != 2:
        raise ValueError(f"advantages {tuple(advantages.shape)} and response_mask "
                         f"{tuple(response_mask.shape)} must both be [B, T]")
    acc = torch.promote_types(advantages.dtype, torch.float32)
    values = advantages.detach().to(acc)
    zero = torch.zeros((), dtype=acc, device=values.device)
    counts = response_mask.sum(dim=1)
    row = torch.where(response_mask, values, zero).sum(dim=1) / counts.clamp(min=1).to(acc)
    spread = torch.where(response_mask, (values - row[:, None]).abs(), zero).amax(dim=1)
    if bool((spread > _ADVANTAGE_RTOL * row.abs().clamp(min=1.0)).any()):
        raise ValueError(
            "advantages vary within a response (largest spread "
            f"{float(spread.max()):.3g}); these losses need one advantage per response: use an "
            "outcome advantage estimator (GRPO, RLOO, REINFORCE++ baseline), not a token-level "
            "one such as GAE"
        )
    return row


def last_token_advantages(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-response advantages ``[B]`` from a layout holding A_i at the last valid token only.

    NeMo-Aligner's ``calculate_ppo_rewards`` puts a scalar reward at the last response token and
    zeros elsewhere. Rows without a valid token get 0.

    Raises:
        ValueError: shapes differ, or a valid token other than the last is non-zero (a per-token
            reward such as a KL penalty folded into the reward, which these losses cannot use).
    """
    if advantages.shape != response_mask.shape or advantages.dim() != 2:
        raise ValueError(f"advantages {tuple(advantages.shape)} and response_mask "
                         f"{tuple(response_mask.shape)} must both be [B, T]")
    acc = torch.promote_types(advantages.dtype, torch.float32)
    values = advantages.detach().to(acc)
    positions = torch.arange(values.shape[1], device=values.device)
    last = torch.where(response_mask, positions, -1).amax(dim=1)
    is_last = positions[None, :] == last[:, None]
    if bool((response_mask & ~is_last & (values != 0)).any()):
        raise ValueError("advantages are non-zero before the last token of a response: this is not "
                         "the last-token layout. Per-token rewards, such as a KL penalty folded "
                         "into the reward, are not supported: set the host's reward KL penalty "
                         "to 0 (NeMo-Aligner: ppo.initial_policy_kl_penalty=0); a reference-KL "
                         "penalty is not available through these adapters. If A_i is broadcast "
                         "to every response token, use advantage_layout='tokens'")
    zero = torch.zeros((), dtype=acc, device=values.device)
    return torch.where(response_mask & is_last, values, zero).sum(dim=1)


def response_segment_ids(loss: BoundPolicyLoss, response_ids: torch.Tensor,
                         response_mask: torch.Tensor, tables: SegmentTables | None) -> torch.Tensor:
    """Segment ids ``[B, T]`` int64 (-1 masked) of the loss's ratio unit, from token ids.

    Args:
        loss: a bound loss; its ``requirements.segmentation`` (and ``segment_k``) pick the
            strategy (``nemo_sspo.algorithms.segmentation``).
        response_ids: ``[B, T]`` int64 token ids aligned with ``response_mask``.
        response_mask: ``[B, T]`` bool.
        tables: ``build_segment_tables(tokenizer)`` of the tokenizer that produced the ids; read by
            the table-based strategies (newline, double_newline, sentence, pause_punctuation);
            may be None otherwise.

    Raises:
        ValueError: the strategy needs tables and none were given, or the strategy's own checks.
    """
    needs = loss.requirements
    if needs.segmentation not in TABLE_FREE_SEGMENTATIONS and tables is None:
        raise ValueError(
            f"loss {loss.name!r} uses segmentation {needs.segmentation!r}, which reads token "
            "texts: pass tables=nemo_sspo.algorithms.segmentation.build_segment_tables(tokenizer)"
        )
    if tables is not None:
        tables = tables.padded(int(response_ids.max()) + 1 if response_ids.numel() else 0)
        tables = SegmentTables(**{f.name: getattr(tables, f.name).to(response_ids.device)
                                  for f in fields(tables)})
    return segment_ids(needs.segmentation, response_ids, response_mask, tables, k=needs.segment_k)


def check_host_config(loss: BoundPolicyLoss, *, host: str, kl_hint: str, entropy_hint: str,
                      max_response_length: int | None = None, check_length: bool = True,
                      tables: SegmentTables | None = None, check_tables: bool = True,
                      reference_logprobs: bool = False) -> None:
    """Reject, at adapter construction, a loss config the host adapter cannot run.

    Host adapters pass no differentiable current entropy to the loss (and most pass no reference
    log-probs), so ``entropy_coef > 0`` / ``kl_coef > 0`` would otherwise fail only at the first
    loss call inside the host. Also checked (each when enabled): "constant-denominator" aggregation
    without ``max_response_length >= 1``, and a segmentation that reads token texts without
    ``tables``.

    Args:
        loss: the bound loss.
        host: the host's name, for the messages.
        kl_hint: where the host's own KL settings are (or why none apply).
        entropy_hint: where the host's own entropy settings are (or why none apply).
        max_response_length: L_max given to the adapter.
        check_length: check ``max_response_length`` against the aggregation mode.
        tables: segment tables given to the adapter.
        check_tables: check ``tables`` against the segmentation.
        reference_logprobs: the adapter passes reference log-probs (``kl_coef > 0`` is allowed).

    Raises:
        ValueError: naming the config field, the host and the fix.
    """
    config, needs = loss.config, loss.requirements
    name = type(config).__name__
    if needs.reference_policy and not reference_logprobs:
        raise ValueError(f"{name}.kl_coef={config.kl_coef}: the {host} adapter passes no reference "
                         f"log-probs to the loss, so set kl_coef=0 here. {kl_hint}")
    if needs.current_entropy:
        raise ValueError(f"{name}.entropy_coef={config.entropy_coef}: the {host} adapter passes no "
                         f"current-policy entropy to the loss, so set entropy_coef=0 here. "
                         f"{entropy_hint}")
    if check_length and config.aggregation == "constant-denominator" and (
            not isinstance(max_response_length, int) or max_response_length < 1):
        raise ValueError(f"{name}.aggregation='constant-denominator' divides by L_max: pass "
                         f"max_response_length= (the generation length cap, an int >= 1) to the "
                         f"{host} adapter, got {max_response_length!r}")
    if check_tables and needs.segmentation not in TABLE_FREE_SEGMENTATIONS and tables is None:
        raise ValueError(f"{name} uses segmentation {needs.segmentation!r}, which reads token "
                         f"texts: pass tables=nemo_sspo.algorithms.segmentation."
                         f"build_segment_tables(tokenizer) to the {host} adapter")


def bind_loss(loss_name: str, loss_config: Any | None) -> BoundPolicyLoss:
    """The registered loss ``loss_name`` bound to its config.

    ``loss_config`` may be the loss's config instance, a mapping of its fields (validated by
    :func:`config_from_args`), or None for the class defaults.

    Raises:
        ValueError: unknown loss name (lists the registered ones), a config of another class, or
            the errors of :func:`config_from_args`.
    """
    config_cls = get_policy_loss(loss_name).config_cls
    if isinstance(loss_config, Mapping):
        loss_config = config_from_args(loss_name, dict(loss_config))
    elif loss_config is not None and not isinstance(loss_config, config_cls):
        raise ValueError(f"loss {loss_name!r} takes a {config_cls.__name__} or a mapping of its "
                         f"fields, got {type(loss_config).__name__}")
    return make_policy_loss(loss_name, loss_config)


def check_old_entropy_source(source: str, batch_keys, required_keys: tuple[str, ...],
                             host: str, *, reads_entropy: bool = True) -> None:
    """Check ``source`` is one of :data:`OLD_ENTROPY_SOURCES` and the batch has what it needs.

    The batch is checked only when it is known (``batch_keys`` not None); it needs
    :data:`PREV_ENTROPY_KEY` only for ``source="batch"`` with a loss that ``reads_entropy``.

    Raises:
        ValueError: naming the bad source or the missing keys and the fix.
    """
    if source not in OLD_ENTROPY_SOURCES:
        raise ValueError(f"old_entropy_source={source!r}; valid: {OLD_ENTROPY_SOURCES}")
    if batch_keys is None:
        return
    needed = required_keys + ((PREV_ENTROPY_KEY,) if source == "batch" and reads_entropy else ())
    missing = [key for key in needed if key not in batch_keys]
    if missing:
        advice = (f"; add {PREV_ENTROPY_KEY!r} (aligned like prev_logprobs) in the log-prob pass, "
                  "or pass old_entropy_source='current'" if PREV_ENTROPY_KEY in missing else "")
        raise ValueError(f"batch lacks {missing}; the {host} batch needs {list(required_keys)}"
                         f"{advice}")


def old_entropy(source: str, batch, current: torch.Tensor | None) -> torch.Tensor:
    """The old-policy entropy of :data:`OLD_ENTROPY_SOURCES` ``source``.

    Aligned like the batch's ``prev_logprobs``.

    Raises:
        ValueError: "current" without logits, a missing stored entropy, or one shaped unlike
            prev_logprobs.
    """
    if source == "current":
        if current is None:
            raise ValueError("old_entropy_source='current' needs the logits path; the host passed "
                             f"log-probs only: provide batch[{PREV_ENTROPY_KEY!r}]")
        return current
    if PREV_ENTROPY_KEY not in batch:
        raise ValueError(f"the batch has no {PREV_ENTROPY_KEY!r} (old-policy entropy, aligned like "
                         "prev_logprobs): add it in the log-prob pass, or pass "
                         "old_entropy_source='current'")
    stored, reference = batch[PREV_ENTROPY_KEY], batch["prev_logprobs"]
    if stored.shape != reference.shape:
        raise ValueError(f"batch[{PREV_ENTROPY_KEY!r}] has shape {tuple(stored.shape)} but "
                         f"prev_logprobs has {tuple(reference.shape)}; store it aligned exactly "
                         "like prev_logprobs")
    return stored


def host_loss_sums(loss: BoundPolicyLoss, *, logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                   advantages: torch.Tensor, response_mask: torch.Tensor,
                   response_ids: torch.Tensor, old_entropy: torch.Tensor | None,
                   tables: SegmentTables | None, max_response_length: int | None,
                   ref_logprobs: torch.Tensor | None = None):
    """One micro-batch of a host: segment ids from the token ids, then the loss's sums.

    That is :func:`nemo_sspo.algorithms.losses.policy_loss_sums`, all tensors ``[B, T]`` in the
    host's response frame, advantages ``[B]``.

    ``old_entropy`` may be None for a loss that does not read it (``requirements.old_entropy``
    False); ``ref_logprobs`` is needed only with ``kl_coef > 0``.

    Returns:
        ``(numerator, denominator, metrics)`` of ``policy_loss_sums``.
    """
    def same_dtype(tensor):
        return None if tensor is None else tensor.to(logprobs.dtype)

    inputs = LossInputs(
        logprobs=logprobs, old_logprobs=old_logprobs.to(logprobs.dtype), advantages=advantages,
        response_mask=response_mask,
        segment_ids=response_segment_ids(loss, response_ids, response_mask, tables),
        old_entropy=same_dtype(old_entropy), ref_logprobs=same_dtype(ref_logprobs),
    )
    return policy_loss_sums(loss, inputs, max_response_length=max_response_length)


def config_from_args(loss_name: str, args: Mapping[str, Any]) -> Any:
    """Instantiate the registered config of ``loss_name`` from keyword ``args``.

    Raises:
        ValueError: unknown loss, a key that is not a field (lists the fields, suggests a close
            match), or the config's own validation
            (:func:`nemo_sspo.algorithms.losses.build_policy_loss_config`).
    """
    return build_policy_loss_config(loss_name, args, where="loss_config")


def shifted_logprobs_entropy(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    *,
    tp_group,
    tp_rank: int,
    vocab_size: int | None,
    temperature: float = 1.0,
    chunk_size: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token log-probs and full-vocabulary entropies from vocab-sharded logits.

    Position ``t`` of the outputs is the prediction of ``tokens[:, t + 1]`` by ``logits[:, t]``
    (the shift is done here); only positions where ``mask`` is True are computed (others are 0),
    through :func:`nemo_sspo.parallel.vocab_parallel_logprobs_entropy` (two all-reduces per chunk on
    ``tp_group``, no vocabulary gather).

    Args:
        logits: ``[B, S, V_local]`` float, this rank's contiguous vocabulary shard
            ``[tp_rank * V_local, (tp_rank + 1) * V_local)`` (Megatron's layout).
        tokens: ``[B, S]`` int64 token ids (prompt + response).
        mask: ``[B, S - 1]`` bool, target positions to compute.
        tp_group: tensor-parallel process group, or None when ``logits`` hold the whole vocabulary.
        tp_rank: this rank's index in ``tp_group`` (0 without a group).
        vocab_size: true vocabulary size; columns at or above it (Megatron's padding) get
            probability 0. None: every column of every shard is a real token
            (``V_local * tp_size``), as the hosts' own log-prob functions assume.
        temperature: divides the logits (1.0 when the host already scaled them).
        chunk_size: tokens per communication chunk.

    Returns:
        ``(logprobs, entropy)``, each ``[B, S - 1]`` float32 (fp64 for fp64 logits), entropy in
        nats; logprobs differentiable w.r.t. ``logits``.

    Raises:
        ValueError: shape mismatch, or the checks of ``vocab_parallel_logprobs_entropy``.
    """
    from nemo_sspo.parallel import vocab_parallel_logprobs_entropy

    if logits.dim() != 3 or tokens.shape != logits.shape[:2]:
        raise ValueError(f"logits must be [B, S, V_local] and tokens [B, S]; got logits "
                         f"{tuple(logits.shape)}, tokens {tuple(tokens.shape)}")
    rows, length = tokens.shape
    if mask.shape != (rows, length - 1):
        raise ValueError(f"mask must be [B, S - 1] = [{rows}, {length - 1}] (target frame), got "
                         f"{tuple(mask.shape)}")
    v_local = logits.shape[-1]
    tp_size = 1 if tp_group is None else torch.distributed.get_world_size(tp_group)
    flat_logprobs, flat_entropy = vocab_parallel_logprobs_entropy(
        logits[:, :-1][mask],
        tokens[:, 1:][mask],
        tp_group=tp_group,
        vocab_start=tp_rank * v_local,
        vocab_size=v_local * tp_size if vocab_size is None else vocab_size,
        temperature=temperature,
        chunk_size=chunk_size,
    )
    zeros = torch.zeros(mask.shape, dtype=flat_logprobs.dtype, device=logits.device)
    return (zeros.masked_scatter(mask, flat_logprobs),
            zeros.masked_scatter(mask, flat_entropy.detach()))


def metric_pairs(metrics: dict[str, MetricPair]) -> dict[str, float]:
    """``{key/sum, key/count}`` floats for every additive metric pair, in one host sync.

    ``"min"`` / ``"max"`` pairs are left out: they do not combine by summation, which is how
    NeMo-RL accumulates loss metrics over micro-batches.
    """
    keys = sorted(k for k, pair in metrics.items() if pair.additive)
    if not keys:
        return {}
    values = torch.stack([metrics[k].as_tensor(torch.float64) for k in keys]).tolist()
    out = {}
    for key, (total, count) in zip(keys, values, strict=True):
        out[f"{key}/sum"], out[f"{key}/count"] = total, count
    return out
