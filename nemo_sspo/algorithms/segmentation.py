"""Line-break segmentation of responses into subsentences (SSPO, arXiv 2511.04256, section 3).

SSPO splits each response at line breaks ("\\n" or "\\n\\n"). BPE tokenizers merge newlines with
their neighbours (Qwen2.5 has '.\\n\\n', ':\\n\\n', ')\\n', ...), so a boundary is any token whose
*decoded text* contains a newline, never the single id of "\\n". Such a token closes its segment;
the next valid token opens a new one.

Segment ids are 0-based per row, contiguous, and -1 at masked positions. Every function here also
serves the other granularities of the ratio ladder (token = GRPO, sequence = GSPO), so all losses
share one code path (see :func:`segment_ids_for_level`).
"""

from __future__ import annotations

import torch

SEGMENT_LEVELS = ("token", "subsentence", "sequence")


def _vocab_size(tokenizer) -> int:
    # transformers tokenizers define __len__ (base vocab + added tokens); a raw
    # `tokenizers.Tokenizer` has no __len__ but get_vocab_size() counts added tokens by default.
    if hasattr(tokenizer, "__len__"):
        return len(tokenizer)
    return tokenizer.get_vocab_size()


def build_boundary_table(tokenizer) -> torch.Tensor:
    """Mark the vocabulary ids whose decoded text contains a newline.

    Args:
        tokenizer: a ``transformers`` tokenizer or a ``tokenizers.Tokenizer``; only ``decode([id])``
            and ``len(tokenizer)`` / ``get_vocab_size()`` are used.

    Returns:
        ``torch.bool`` tensor ``[V_tok]`` (``V_tok`` = tokenizer vocabulary incl. added tokens):
        True where the token closes a segment. Build it once per tokenizer (it decodes every id).
    """
    size = _vocab_size(tokenizer)
    flags = ["\n" in tokenizer.decode([token_id]) for token_id in range(size)]
    return torch.tensor(flags, dtype=torch.bool)


def _check_ids_and_mask(response_ids: torch.Tensor, response_mask: torch.Tensor) -> None:
    if response_ids.dim() != 2 or response_ids.shape != response_mask.shape:
        raise ValueError(
            f"response_ids {tuple(response_ids.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both be [B, T] with the same shape"
        )
    if response_mask.dtype != torch.bool:
        raise ValueError(f"response_mask must be torch.bool, got {response_mask.dtype}")


def newline_segment_ids(
    response_ids: torch.Tensor, response_mask: torch.Tensor, boundary: torch.Tensor
) -> torch.Tensor:
    """Split each row into line-break segments.

    Args:
        response_ids: ``[B, T]`` int64 token ids of the responses.
        response_mask: ``[B, T]`` bool, True at response tokens that take part in the loss. Masked
            positions may hold any id (padding) and never start or close a segment.
        boundary: ``[V_tok]`` bool from :func:`build_boundary_table`.

    Returns:
        ``[B, T]`` int64: 0-based segment index of each valid token within its row, -1 where the
        mask is False. A boundary token belongs to the segment it closes.

    Raises:
        ValueError: shapes differ, mask not bool, or a valid token id lies outside
            ``[0, len(boundary))`` (build the table from the tokenizer that produced the ids).
    """
    _check_ids_and_mask(response_ids, response_mask)
    boundary = boundary.to(response_ids.device)
    valid_ids = response_ids[response_mask]
    if valid_ids.numel() and (valid_ids.min() < 0 or valid_ids.max() >= boundary.numel()):
        raise ValueError(
            f"response_ids hold ids in [{int(valid_ids.min())}, {int(valid_ids.max())}] but the "
            f"boundary table covers [0, {boundary.numel()}); build it from the same tokenizer"
        )
    closes = boundary[response_ids.clamp(0, boundary.numel() - 1)] & response_mask
    # A token's segment index = number of boundary tokens strictly before it in its row.
    before = torch.cumsum(closes.long(), dim=1) - closes.long()
    return torch.where(response_mask, before, torch.full_like(before, -1))


def segment_ids_for_level(
    level: str,
    response_mask: torch.Tensor,
    newline_segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Segment ids for one rung of the ratio ladder.

    Args:
        level: ``"token"`` (each valid token its own segment: GRPO ratio), ``"sequence"`` (one
            segment per row: GSPO ratio) or ``"subsentence"`` (line-break segments: SSPO ratio).
        response_mask: ``[B, T]`` bool.
        newline_segment_ids: ``[B, T]`` int64 from :func:`newline_segment_ids`; required for
            ``"subsentence"``, not read by the other levels.

    Returns:
        ``[B, T]`` int64, 0-based contiguous per row, -1 at masked positions.

    Raises:
        ValueError: unknown level, ``newline_segment_ids`` missing for ``"subsentence"``, or
            shape mismatch.
    """
    if response_mask.dim() != 2 or response_mask.dtype != torch.bool:
        raise ValueError(
            f"response_mask must be a [B, T] bool tensor, got {tuple(response_mask.shape)} "
            f"{response_mask.dtype}"
        )
    minus_one = torch.full(response_mask.shape, -1, dtype=torch.long, device=response_mask.device)
    if level == "token":
        position = torch.cumsum(response_mask.long(), dim=1) - 1
        return torch.where(response_mask, position, minus_one)
    if level == "sequence":
        return torch.where(response_mask, torch.zeros_like(minus_one), minus_one)
    if level == "subsentence":
        if newline_segment_ids is None:
            raise ValueError(
                "level='subsentence' needs newline_segment_ids (from newline_segment_ids())"
            )
        if newline_segment_ids.shape != response_mask.shape:
            raise ValueError(
                f"newline_segment_ids has shape {tuple(newline_segment_ids.shape)} but "
                f"response_mask has shape {tuple(response_mask.shape)}"
            )
        return torch.where(response_mask, newline_segment_ids.long(), minus_one)
    raise ValueError(f"unknown segment level {level!r}; valid levels: {SEGMENT_LEVELS}")
