"""The trainer's batch type and the conversions from rollout (response) frame to target frame.

Plain torch, no process groups: the bottom layer, so that ``megatron/`` (which runs the batch
through Megatron's schedules) and ``trainer/`` (which builds it from rollouts) both import it from
below. All tensors of a :class:`PolicyBatch` are in the *target frame*: position ``j`` holds the
prediction of token ``j + 1`` of ``input_ids`` (Megatron returns logits at every position).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Protocol

import torch

from nemo_sspo.algorithms.critic import critic_targets

__all__ = ["CriticBatch", "PolicyBatch", "RolloutTensors", "concat_policy_batches", "pack_critic_batch", "pack_rollouts",
           "pack_rows", "pack_tokens", "pad_cat", "response_to_target_frame", "route_dtype"]


def route_dtype(num_experts: int) -> torch.dtype:
    """The integer dtype MoE routes (expert ids ``0 .. E - 1``) are held and sent in: ``torch.int16``
    when every id fits (E <= 32768), else ``torch.int32``. Routes are ``[B, S, L, k]`` per batch, so
    this is a quarter (a half) of int64's bytes; index ops that need int64 convert at the op.

    Raises:
        ValueError: ``num_experts < 1``.
    """
    if num_experts < 1:
        raise ValueError(f"num_experts={num_experts} must be >= 1")
    return torch.int16 if num_experts - 1 <= torch.iinfo(torch.int16).max else torch.int32


class RolloutTensors(Protocol):
    """The response-frame tensors :meth:`PolicyBatch.from_rollout` reads (a rollout engine's batch).

    Attributes:
        prompt_ids: ``[B, P]`` int64, left-padded prompts; prompt_mask: ``[B, P]`` bool.
        response_ids: ``[B, T]`` int64, right-padded responses; response_mask: ``[B, T]`` bool.
        rollout_logprobs: ``[B, T]`` float32, the engine's log-probs of the sampled tokens.
        routes: ``[B, S, L_all, k]`` experts the engine chose (dtype :func:`route_dtype`) for each input token, in the
            packed input frame of :func:`pack_tokens` (row ``b``'s prompt then response tokens at
            ``0 .. P_b + T_b - 1``), for all ``L_all`` MoE layers; or None (dense models, or an
            engine that does not report routes).
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    routes: torch.Tensor | None


@dataclass
class PolicyBatch:
    """One micro-batch (or a whole batch) of packed rollouts.

    Attributes:
        input_ids: [B, S] int64, prompt then response tokens, right-padded.
        position_ids: [B, S] int64, 0..S-1 (right padding keeps valid positions causal-correct).
        targets: [B, S] int64, ``input_ids`` shifted left by one (last column padding).
        loss_mask: [B, S] bool, True where ``targets`` is a response token.
        segment_ids: [B, S] int64, index of the target token's segment within its response under
            the loss config's ``segmentation`` (newline by default), -1 where ``loss_mask`` is False.
        old_logprobs: [B, S] float32, log pi_old of the target tokens (0 outside the mask).
        old_entropy: [B, S] float32, entropy of pi_old at each position, nats (0 outside the mask).
        advantages: [B] float32, one advantage per response.
        ref_logprobs: [B, S] float32, log pi_ref of the target tokens under the frozen reference
            policy (0 outside the mask), or None when the loss has no reference-KL term
            (``kl_coef == 0``).
        tis_weights: [B, S] float32 off-policy correction weights (truncated or masked importance
            weights, ``nemo_sspo.algorithms.off_policy``; 1 outside the mask) multiplying each
            token's loss, or None (``rollout.correction.name=none``).
        lengths: [B] int64 valid input tokens of each row (prompt + response; the rest is right
            padding), or None when every position of every row is valid.
        rollout_logprobs: [B, S] float32 log-probs of the target tokens under the rollout engine
            (0 outside the mask), or None. Carried with the rows so that whatever rank a row moves
            to (``nemo_sspo.parallel.data_balance``) reads its own engine log-probs (TIS weights,
            the trainer-vs-engine gap metric).
        routes: [B, S, L, k] MoE routes (dtype :func:`route_dtype`; mixture-of-experts models with
            ``model.router_replay``): the k experts of input token ``(b, s)`` in MoE layer ``l`` of
            this rank's pipeline stage, which the training forwards replay (R2: the old-policy
            forward's, R3: the rollout engine's); or None.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    segment_ids: torch.Tensor
    old_logprobs: torch.Tensor
    old_entropy: torch.Tensor
    advantages: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    tis_weights: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    routes: torch.Tensor | None = None

    @classmethod
    def from_rollout(cls, rollout: RolloutTensors, segment_ids: torch.Tensor, advantages: torch.Tensor, *,
                     pad_id: int, route_layers: list[int] | None = None) -> "PolicyBatch":
        """The one way from a scored rollout to a batch: its rows packed into the target frame
        (:func:`pack_rollouts`) with the engine's log-probs placed there too (``rollout_logprobs``),
        and, given ``route_layers``, the engine's routes of those MoE layers as ``routes`` (router
        replay R3; the routes are already in the packed input frame).

        Args:
            rollout: the response-frame tensors of the rollout (a ``nemo_sspo.rollout.RolloutBatch``).
            segment_ids: ``[B, T]`` int64 segment ids of the loss's unit, response frame (-1 at padding).
            advantages: ``[B]`` float32.
            pad_id: token id written at padding positions.
            route_layers: indices into ``rollout.routes``'s ``L_all`` MoE layers of this pipeline
                stage's layers, in its layer order; None leaves ``routes`` None.

        Returns:
            the batch, old log-probs and entropies still zero (the trainer fills them).

        Raises:
            ValueError: leading dimensions disagree (names the argument); ``route_layers`` given but
                the rollout has no routes, or routes whose width is not the packed rows' width.
        """
        batch = pack_rollouts(rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids,
                              rollout.response_mask, segment_ids, advantages, pad_id=pad_id)
        engine_logprobs = response_to_target_frame(rollout.rollout_logprobs, rollout.prompt_mask,
                                                   batch.loss_mask.shape[1])
        batch = replace(batch, rollout_logprobs=engine_logprobs)
        if route_layers is None:
            return batch
        routes = rollout.routes
        if routes is None or routes.shape[:2] != batch.input_ids.shape:
            shape = None if routes is None else tuple(routes.shape)
            raise ValueError(f"rollout.routes is {shape}, expected [B, S, L_all, k] with [B, S] = "
                             f"{tuple(batch.input_ids.shape)} (the packed prompt + response tokens): the "
                             "rollout engine must record its routes (router replay r3)")
        return replace(batch, routes=routes[:, :, route_layers])

    def select(self, rows: slice) -> "PolicyBatch":
        """Rows ``rows`` of every tensor field, as a new batch (views, no copy; None stays None)."""
        return PolicyBatch(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[rows]
                              for f in fields(self)})

    def row_lengths(self) -> torch.Tensor:
        """``[B]`` int64 valid tokens of each row: ``lengths``, or the full width ``S`` when it is None."""
        if self.lengths is not None:
            return self.lengths
        return torch.full((self.input_ids.shape[0],), self.input_ids.shape[1], dtype=torch.long)

    def narrow(self, width: int) -> "PolicyBatch":
        """The first ``width`` columns of every ``[B, S, ...]`` field (views; ``[B]`` fields and None
        stay): drops right padding when ``width`` is at least the longest row.
        """
        return PolicyBatch(**{f.name: v[:, :width] if isinstance(v := getattr(self, f.name), torch.Tensor)
                              and v.dim() >= 2 else v for f in fields(self)})


# What the columns past a row's end hold in each 2-D field (pack_rollouts's padding, except token ids:
# 0 here, its pad_id there): the loss never reads them (loss_mask False) and causal attention keeps
# them out of the valid positions.
_PADDING = {"segment_ids": -1, "tis_weights": 1.0}


def pad_cat(tensors: list[torch.Tensor], value, *, left: bool = False) -> torch.Tensor:
    """Concatenates ``[B_k, L_k, ...]`` tensors along rows, padding dim 1 to ``max L_k`` with
    ``value`` (on the left when ``left``, else on the right).
    """
    width = max(t.shape[1] for t in tensors)
    padded = []
    for t in tensors:
        inner = [0, 0] * (t.dim() - 2)  # F.pad lists the last dimension first
        pad = inner + ([width - t.shape[1], 0] if left else [0, width - t.shape[1]])
        padded.append(torch.nn.functional.pad(t, pad, value=value))
    return torch.cat(padded)


def concat_policy_batches(parts: list[PolicyBatch]) -> PolicyBatch:
    """Stacks batches along rows; each ``[B_k, S_k]`` field is right-padded to ``max S_k`` as
    :func:`pack_rollouts` pads (0 / False, ``segment_ids`` -1, ``tis_weights`` 1; token ids 0, not
    its ``pad_id``, which nothing reads at padding) and
    ``position_ids`` is ``arange`` of the new width. ``lengths`` stays None only when every part
    has None and one width (no row gains padding); otherwise a part without ``lengths`` gets its
    full width ``S_k`` for each row (None means every position is valid).

    Raises:
        ValueError: no parts, or parts that disagree on whether an optional field
            (``ref_logprobs``, ``tis_weights``, ``rollout_logprobs``) is present.
    """
    if not parts:
        raise ValueError("concat_policy_batches needs at least one batch")
    # Padding added, or some lengths given: None would call the padding valid tokens.
    if len({p.input_ids.shape[1] for p in parts}) > 1 or any(p.lengths is not None for p in parts):
        parts = [replace(p, lengths=p.row_lengths()) for p in parts]
    merged = {}
    for f in fields(PolicyBatch):
        values = [getattr(p, f.name) for p in parts]
        if all(v is None for v in values):
            merged[f.name] = None
        elif any(v is None for v in values):
            raise ValueError(f"PolicyBatch.{f.name} is set in some batches and None in others")
        elif values[0].dim() == 1:
            merged[f.name] = torch.cat(values)
        else:
            merged[f.name] = pad_cat(values, _PADDING.get(f.name, 0))
    rows, width = merged["input_ids"].shape
    merged["position_ids"] = torch.arange(width).expand(rows, width).contiguous()
    return PolicyBatch(**merged)


def _row_offsets(prompt_mask: torch.Tensor) -> torch.Tensor:
    """Target-frame column of each row's first response token: prompt length - 1. [B] int64."""
    return prompt_mask.sum(dim=1) - 1


def response_to_target_frame(values: torch.Tensor, prompt_mask: torch.Tensor, seq_len: int, fill=0):
    """Places response-frame values [B, T] at their target-frame columns of a [B, seq_len] tensor.

    Response token ``t`` of row ``b`` is predicted at target column ``P_b - 1 + t`` where ``P_b`` is
    the row's unpadded prompt length. Positions without a response token get ``fill``.
    """
    rows, resp_len = values.shape
    out = torch.full((rows, seq_len), fill, dtype=values.dtype)
    cols = _row_offsets(prompt_mask)[:, None] + torch.arange(resp_len)[None, :]
    keep = cols < seq_len
    row_idx = torch.arange(rows)[:, None].expand_as(cols)
    out[row_idx[keep], cols[keep]] = values[keep]
    return out


def pack_rows(values: torch.Tensor, mask: torch.Tensor, fill) -> torch.Tensor:
    """Moves each row's valid entries to its front, in order: ``values [B, L, ...]`` where
    ``mask [B, L]`` bool is True -> ``[B, S, ...]``, ``S = max`` valid count, the rest ``fill``.
    """
    lengths = mask.sum(dim=1)
    out = values.new_full((values.shape[0], int(lengths.max()), *values.shape[2:]), fill)
    out[torch.arange(out.shape[1])[None, :] < lengths[:, None]] = values[mask]  # row-major on both sides
    return out


def pack_tokens(parts: list[tuple[torch.Tensor, torch.Tensor]], *, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenates, row by row, the valid tokens of several ``(ids [B, L_k] int64, mask [B, L_k] bool)``
    parts (any padding side) and right-pads the rows with ``pad_id`` (:func:`pack_rows`).

    Returns:
        ``(input_ids [B, S] int64, lengths [B] int64)`` with ``S = max(lengths)``; row ``b`` holds its
        ``lengths[b]`` valid tokens at positions ``0 .. lengths[b] - 1``.
    """
    mask = torch.cat([m for _, m in parts], dim=1)
    input_ids = pack_rows(torch.cat([ids for ids, _ in parts], dim=1).long(), mask, pad_id)
    return input_ids, mask.sum(dim=1)


def pack_rollouts(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    segment_ids: torch.Tensor,
    advantages: torch.Tensor,
    *,
    pad_id: int,
) -> PolicyBatch:
    """Builds a :class:`PolicyBatch` (old log-probs/entropy zero, filled in later).

    Args:
        prompt_ids: [B, P] int64, LEFT-padded prompts.
        prompt_mask: [B, P] bool, True on prompt tokens.
        response_ids: [B, T] int64, RIGHT-padded responses.
        response_mask: [B, T] bool, True on response tokens.
        segment_ids: [B, T] int64 segment ids of the loss's segmentation in the response frame
            (-1 at padding).
        advantages: [B] float32.
        pad_id: token id written at padding positions.

    Each row becomes ``prompt tokens + response tokens`` right-padded to ``S = max(P_b + T_b)``,
    so positions ``0..S-1`` are the true positions of every valid token.

    Raises:
        ValueError: leading dimensions disagree.
    """
    rows = prompt_ids.shape[0]
    for name, t in (("prompt_mask", prompt_mask), ("response_ids", response_ids),
                    ("response_mask", response_mask), ("segment_ids", segment_ids),
                    ("advantages", advantages)):
        if t.shape[0] != rows:
            raise ValueError(f"{name} has {t.shape[0]} rows, prompt_ids has {rows}")
    input_ids, lengths = pack_tokens([(prompt_ids, prompt_mask), (response_ids, response_mask)],
                                     pad_id=pad_id)
    seq_len = input_ids.shape[1]
    targets = torch.cat([input_ids[:, 1:], torch.full((rows, 1), pad_id, dtype=torch.long)], dim=1)
    loss_mask = response_to_target_frame(response_mask, prompt_mask, seq_len, fill=False)
    zeros = torch.zeros(rows, seq_len, dtype=torch.float32)
    return PolicyBatch(
        input_ids=input_ids,
        position_ids=torch.arange(seq_len).expand(rows, seq_len).contiguous(),
        targets=targets,
        loss_mask=loss_mask,
        segment_ids=response_to_target_frame(segment_ids, prompt_mask, seq_len, fill=-1),
        old_logprobs=zeros,
        old_entropy=zeros.clone(),
        advantages=advantages.to(torch.float32),
        lengths=lengths,
    )


@dataclass
class CriticBatch:
    """Prompts for the critic, right-padded.

    Attributes:
        input_ids: [n, P] int64 prompt tokens, right-padded.
        position_ids: [n, P] int64, 0..P-1.
        last_index: [n] int64, column of each prompt's last token (its length - 1).
        targets: [n] float32 BCE targets (:func:`critic_targets`).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    last_index: torch.Tensor
    targets: torch.Tensor

    def select(self, rows: slice) -> "CriticBatch":
        """Rows ``rows`` of every field (views)."""
        return CriticBatch(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})


def pack_critic_batch(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, rewards: torch.Tensor,
                      samples_per_prompt: int, *, pad_id: int) -> CriticBatch:
    """One critic row per prompt group from a rollout's LEFT-padded ``[B, P]`` prompts and ``[B]`` rewards."""
    firsts = slice(0, prompt_ids.shape[0], samples_per_prompt)
    input_ids, lengths = pack_tokens([(prompt_ids[firsts], prompt_mask[firsts])], pad_id=pad_id)
    rows, width = input_ids.shape
    return CriticBatch(input_ids=input_ids, position_ids=torch.arange(width).expand(rows, width).contiguous(),
                       last_index=lengths - 1, targets=critic_targets(rewards, samples_per_prompt))
