"""Packing rollouts into the trainer's target-frame layout (:class:`PolicyBatch`)."""

from __future__ import annotations

import torch

from nemo_sspo.megatron.step import PolicyBatch
from nemo_sspo.rollout import RolloutBatch

__all__ = ["concat_rollouts", "pack_rollouts", "pack_tokens", "response_to_target_frame"]


def _pad_cat(tensors: list[torch.Tensor], value, *, left: bool) -> torch.Tensor:
    """Concatenates [B_k, L_k] tensors along rows, padding the columns to max L_k."""
    width = max(t.shape[1] for t in tensors)
    padded = []
    for t in tensors:
        pad = (width - t.shape[1], 0) if left else (0, width - t.shape[1])
        padded.append(torch.nn.functional.pad(t, pad, value=value))
    return torch.cat(padded)


def concat_rollouts(parts: list[RolloutBatch], *, pad_id: int) -> RolloutBatch:
    """Stacks rollout batches (e.g. one per prompt group) along rows.

    Prompts ``[B_k, P_k]`` are left-padded to ``max P_k`` with ``pad_id`` (mask False), responses
    ``[B_k, T_k]`` and their float32 rollout log-probs right-padded to ``max T_k`` (pad_id / False /
    0.0); truncation flags and texts are concatenated in order.
    """
    return RolloutBatch(
        prompt_ids=_pad_cat([p.prompt_ids for p in parts], pad_id, left=True),
        prompt_mask=_pad_cat([p.prompt_mask for p in parts], False, left=True),
        response_ids=_pad_cat([p.response_ids for p in parts], pad_id, left=False),
        response_mask=_pad_cat([p.response_mask for p in parts], False, left=False),
        truncated=torch.cat([p.truncated for p in parts]),
        response_texts=[text for p in parts for text in p.response_texts],
        rollout_logprobs=_pad_cat([p.rollout_logprobs for p in parts], 0.0, left=False),
    )


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


def pack_tokens(parts: list[tuple[torch.Tensor, torch.Tensor]], *, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenates, row by row, the valid tokens of several ``(ids [B, L_k] int64, mask [B, L_k] bool)``
    parts (any padding side) and right-pads the rows with ``pad_id``.

    Returns:
        ``(input_ids [B, S] int64, lengths [B] int64)`` with ``S = max(lengths)``; row ``b`` holds its
        ``lengths[b]`` valid tokens at positions ``0 .. lengths[b] - 1``.
    """
    counts = torch.stack([mask.sum(dim=1) for _, mask in parts], dim=1)  # [B, K]
    lengths = counts.sum(dim=1)
    input_ids = torch.full((counts.shape[0], int(lengths.max())), pad_id, dtype=torch.long)
    for b in range(counts.shape[0]):
        input_ids[b, : int(lengths[b])] = torch.cat([ids[b][mask[b]] for ids, mask in parts])
    return input_ids, lengths


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
        prompt_ids: [B, P] int64, LEFT-padded prompts; prompt_mask: [B, P] bool.
        response_ids: [B, T] int64, RIGHT-padded responses; response_mask: [B, T] bool.
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
    input_ids, _ = pack_tokens([(prompt_ids, prompt_mask), (response_ids, response_mask)], pad_id=pad_id)
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
    )
