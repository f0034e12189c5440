r"""Segmentation of responses into the units of a segment-level importance ratio.

SSPO (arXiv 2511.04256, section 3) splits each response at line breaks ("\n" or "\n\n"). BPE
tokenizers merge newlines with their neighbours (Qwen2.5 has '.\n\n', ':\n\n', ')\n', ...), so a
boundary is any token whose *decoded text* contains a newline, never the single id of "\n". Such a
token closes its segment; the next valid token opens a new one.

Strategies (:data:`SEGMENTATIONS`, selected by a loss config's ``segmentation`` field):

- ``"newline"`` (default): a token whose text contains "\n" closes its segment.
- ``"double_newline"``: only blank lines split. A blank line is "\n", optional spaces/tabs,
  "\n". A token whose text contains one closes its segment, and so does a token starting (after
  spaces/tabs) with "\n" right after a token ending (before spaces/tabs) with "\n": a blank line
  the tokenizer split over two tokens, e.g. Qwen2.5's '.\n' + ' \n'. Runs of three or more separate
  "\n" tokens can give one-token segments; BPE vocabularies usually hold such runs as one token.
- ``"sentence"``: a token closes its segment when its text holds '.', '!' or '?' followed by white
  space, or ends with one of them while the next token (adjacent position, also valid) starts with
  white space. Newlines alone do not split; "e.g. " does (no abbreviation list).
- ``"pause_punctuation"``: LPO's unit (Ling 2.0 report, arXiv 2510.22115, section 4.2.2: sentences
  "segmented by common pause punctuation marks after detokenization"). The same rule as
  ``"sentence"`` over the ASCII marks ``, ; : . ? !``, and any full-width CJK mark
  ``\uff0c \u3002 \uff1b \uff1a \uff1f \uff01 \u3001`` closes wherever it stands (CJK text has no
  space after it). The report names no mark list; this set, and the space rule that keeps "3.14"
  and "1,000" whole, are ours. Newlines alone do not split. A CJK mark that a byte-level BPE splits
  over several tokens decodes to replacement characters per token and is not seen.
- ``"fixed_k"``: consecutive runs of k valid tokens.
- ``"response"``: the whole response is one segment (the GSPO ratio).
- ``"token"``: every token is its own segment (the GRPO ratio).

Segment ids are 0-based per row, contiguous, and -1 at masked positions; a boundary token belongs
to the segment it closes. The table-based strategies read per-vocabulary flags built once per
tokenizer by :func:`build_segment_tables` (it decodes every id once). :func:`segment_ids` is the
single entry point; :func:`mask_segment_ids` gives the "token" and "response" units from the mask
alone (for callers without token ids).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

import torch

from nemo_sspo.algorithms.aggregation import check_response_matrix

SEGMENTATIONS = ("newline", "double_newline", "sentence", "pause_punctuation", "fixed_k",
                 "response", "token")
TABLE_FREE_SEGMENTATIONS = ("fixed_k", "response", "token")
_MASK_ONLY = ("token", "response")

_SENTENCE_END_INSIDE = re.compile(r"[.!?]\s")
_BLANK_LINE = re.compile(r"\n[ \t]*\n")
_SENTENCE_PUNCTUATION = (".", "!", "?")
# LPO's pause marks: ASCII ones only before white space (so "3.14", "1,000" stay whole), CJK always.
_PAUSE_INSIDE = re.compile(r"[,;:.!?]\s|[\uff0c\u3002\uff1b\uff1a\uff1f\uff01\u3001]")
_PAUSE_PUNCTUATION = (",", ";", ":", ".", "!", "?")


def _vocab_size(tokenizer) -> int:
    # transformers tokenizers define __len__ (base vocab + added tokens); a raw
    # `tokenizers.Tokenizer` has no __len__ but get_vocab_size() counts added tokens by default.
    if hasattr(tokenizer, "__len__"):
        return len(tokenizer)
    return tokenizer.get_vocab_size()


def _decoded_vocabulary(tokenizer) -> list[str]:
    return [tokenizer.decode([token_id]) for token_id in range(_vocab_size(tokenizer))]


@dataclass(frozen=True)
class SegmentTables:
    r"""Per-vocabulary-id flags read by the table-based strategies; each a ``[V_tok]`` bool tensor.

    Attributes:
        newline: decoded text contains "\n".
        double_newline: text contains a blank line ("\n", optional spaces/tabs, "\n").
        starts_newline: text starts with "\n" after optional spaces/tabs.
        ends_newline: text ends with "\n" before optional spaces/tabs.
        sentence_end: text contains '.', '!' or '?' followed by a white-space character.
        ends_punctuation: text ends with '.', '!' or '?'.
        starts_space: text starts with a white-space character.
        pause_inside: text contains an ASCII pause mark (``, ; : . ? !``) followed by white space,
            or a full-width CJK pause mark anywhere.
        ends_pause: text ends with an ASCII pause mark.
    """

    newline: torch.Tensor
    double_newline: torch.Tensor
    starts_newline: torch.Tensor
    ends_newline: torch.Tensor
    sentence_end: torch.Tensor
    ends_punctuation: torch.Tensor
    starts_space: torch.Tensor
    pause_inside: torch.Tensor
    ends_pause: torch.Tensor

    @property
    def vocab_size(self) -> int:
        """Number of ids the tables cover."""
        return self.newline.numel()

    def padded(self, vocab_size: int) -> SegmentTables:
        """Tables extended with False rows up to ``vocab_size`` ids.

        A model's vocabulary can exceed its tokenizer's (Qwen2.5: 151,936 rows vs 151,665 ids);
        ids the tokenizer never decodes close no segment. A smaller ``vocab_size`` is a no-op.
        """
        extra = max(0, vocab_size - self.vocab_size)
        return SegmentTables(**{
            f.name: torch.nn.functional.pad(getattr(self, f.name), (0, extra)) for f in fields(self)
        })


def build_segment_tables(tokenizer) -> SegmentTables:
    """Decode every vocabulary id once and derive the flags of :class:`SegmentTables`.

    Args:
        tokenizer: a ``transformers`` tokenizer or a ``tokenizers.Tokenizer``; only ``decode([id])``
            and ``len(tokenizer)`` / ``get_vocab_size()`` are used.

    Returns:
        :class:`SegmentTables` covering ``[0, V_tok)`` (``V_tok`` = tokenizer vocabulary incl.
        added tokens). Build them once per tokenizer (it decodes every id).
    """
    texts = _decoded_vocabulary(tokenizer)

    def flags(test) -> torch.Tensor:
        return torch.tensor([bool(test(text)) for text in texts], dtype=torch.bool)

    return SegmentTables(
        newline=flags(lambda s: "\n" in s),
        double_newline=flags(_BLANK_LINE.search),
        starts_newline=flags(lambda s: s.lstrip(" \t").startswith("\n")),
        ends_newline=flags(lambda s: s.rstrip(" \t").endswith("\n")),
        sentence_end=flags(_SENTENCE_END_INSIDE.search),
        ends_punctuation=flags(lambda s: s.endswith(_SENTENCE_PUNCTUATION)),
        starts_space=flags(lambda s: s[:1].isspace()),
        pause_inside=flags(_PAUSE_INSIDE.search),
        ends_pause=flags(lambda s: s.endswith(_PAUSE_PUNCTUATION)),
    )


def _lookup(table: torch.Tensor, response_ids: torch.Tensor, response_mask: torch.Tensor):
    """``table[id]`` at every position, False where masked; ids of valid tokens range-checked."""
    table = table.to(response_ids.device)
    valid_ids = response_ids[response_mask]
    if valid_ids.numel() and (valid_ids.min() < 0 or valid_ids.max() >= table.numel()):
        raise ValueError(
            f"response_ids hold ids in [{int(valid_ids.min())}, {int(valid_ids.max())}] but the "
            f"boundary table covers [0, {table.numel()}); build it from the same tokenizer "
            "(and pad it to the model's vocabulary with SegmentTables.padded)"
        )
    return table[response_ids.clamp(0, table.numel() - 1)] & response_mask


def _ids_from_closes(closes: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    # A token's segment index = number of closing tokens strictly before it in its row.
    closes = (closes & response_mask).long()
    before = torch.cumsum(closes, dim=1) - closes
    return torch.where(response_mask, before, torch.full_like(before, -1))


def _shift(flags: torch.Tensor, steps: int) -> torch.Tensor:
    """``out[:, t] = flags[:, t - steps]`` (False where that position does not exist)."""
    out = torch.zeros_like(flags)
    if steps > 0:
        out[:, steps:] = flags[:, :-steps]
    else:
        out[:, :steps] = flags[:, -steps:]
    return out


def _table_closes(strategy: str, response_ids, response_mask, tables: SegmentTables):
    def look(table):
        return _lookup(table, response_ids, response_mask)

    if strategy == "newline":
        return look(tables.newline)
    if strategy == "double_newline":
        # A blank line split over two tokens: "...\n" then "\n...".
        split_blank = _shift(look(tables.ends_newline), 1) & look(tables.starts_newline)
        return look(tables.double_newline) | split_blank
    # sentence / pause_punctuation: a mark + space inside the token, or a mark now, a space next.
    inside, ends = ((tables.sentence_end, tables.ends_punctuation) if strategy == "sentence"
                    else (tables.pause_inside, tables.ends_pause))
    next_starts_space = _shift(look(tables.starts_space), -1)
    return look(inside) | (look(ends) & next_starts_space)


def segment_ids(
    strategy: str,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    tables: SegmentTables | None = None,
    *,
    k: int | None = None,
) -> torch.Tensor:
    """Segment ids of every response under one segmentation strategy (module docstring).

    Args:
        strategy: one of :data:`SEGMENTATIONS`.
        response_ids: ``[B, T]`` int64 token ids (read by the table-based strategies only).
        response_mask: ``[B, T]`` bool, True at response tokens in the loss; masked positions may
            hold any id and never start or close a segment.
        tables: :class:`SegmentTables` of the tokenizer (padded to the model vocabulary); required
            by the strategies that split on decoded text (``"newline"``, ``"double_newline"``,
            ``"sentence"``, ``"pause_punctuation"``), not read by the others.
        k: tokens per segment; required (>= 1) by ``"fixed_k"`` and must be None otherwise.

    Returns:
        ``[B, T]`` int64, 0-based contiguous per row, -1 at masked positions.

    Raises:
        ValueError: unknown strategy (lists the valid ones), missing tables, bad ``k``, shape or
            dtype mismatch, or a valid id outside the tables.
    """
    if strategy not in SEGMENTATIONS:
        raise ValueError(f"unknown segmentation {strategy!r}; valid: {SEGMENTATIONS}")
    check_response_matrix("response_ids", response_ids, response_mask)
    if strategy == "fixed_k":
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"segmentation 'fixed_k' needs an int k >= 1, got k={k!r}")
    elif k is not None:
        raise ValueError(f"k={k!r} is only read by segmentation 'fixed_k', not {strategy!r}; "
                         "pass k=None")
    if strategy in _MASK_ONLY:
        return mask_segment_ids(strategy, response_mask)
    if strategy == "fixed_k":
        position = torch.cumsum(response_mask.long(), dim=1) - 1
        return torch.where(response_mask, position // k, torch.full_like(position, -1))
    if tables is None:
        raise ValueError(f"segmentation {strategy!r} needs tables=build_segment_tables(tokenizer)")
    closes = _table_closes(strategy, response_ids, response_mask, tables)
    return _ids_from_closes(closes, response_mask)


def mask_segment_ids(strategy: str, response_mask: torch.Tensor) -> torch.Tensor:
    """Segment ids of the units that need no token ids: ``"token"`` (every valid token its own
    segment, the GRPO ratio) or ``"response"`` (one segment per row, the GSPO ratio).

    Args:
        strategy: ``"token"`` or ``"response"``.
        response_mask: ``[B, T]`` bool.

    Returns:
        ``[B, T]`` int64, 0-based contiguous per row, -1 at masked positions.

    Raises:
        ValueError: another strategy, or a mask that is not ``[B, T]`` bool.
    """
    if strategy not in _MASK_ONLY:
        raise ValueError(f"mask_segment_ids computes {_MASK_ONLY}, not {strategy!r}; use segment_ids")
    if response_mask.dim() != 2 or response_mask.dtype != torch.bool:
        raise ValueError(f"response_mask must be a [B, T] bool tensor, got {tuple(response_mask.shape)} "
                         f"{response_mask.dtype}")
    if strategy == "token":
        position = torch.cumsum(response_mask.long(), dim=1) - 1
    else:
        position = torch.zeros(response_mask.shape, dtype=torch.long, device=response_mask.device)
    return torch.where(response_mask, position, torch.full_like(position, -1))
