"""How a batch of rollouts becomes micro-batches: fixed rows, a token budget, or packed sequences.

Three layouts of the same rows, each giving the same step (the loss is a sum of per-micro-batch
numerators over a sum of denominators, so any grouping of rows gives the same result):

- fixed (``max_tokens=None``): consecutive blocks of ``micro_batch_size`` rows, every row padded
  to the batch's longest (the shapes Megatron's pipeline schedule expects by default);
- token budget (``max_tokens``, ``pack=False``): rows sorted by length, cut into micro-batches
  whose padded size ``rows x longest row`` stays within ``max_tokens``; each micro-batch is trimmed
  to its own longest row, so little padding is computed;
- packed (``max_tokens``, ``pack=True``): the sequences (prompt + response) are laid end to end in
  one row of at most ``max_tokens`` positions (first-fit decreasing), attention confined to each
  sequence. The loss still sees one response per row (:attr:`MicroBatch.batch`): the model's output
  at packed position ``token_index[b, j]`` is response ``b``'s prediction at target column ``j``,
  so segment ratios and response-level aggregation stay per sequence (docs/pitfalls.md#p2).

Rows whose every position is the target frame's padding still count (zero-length responses keep
their prompt), so denominators are unchanged. The layout is ours.

Each data-parallel rank plans its own rows, so ranks may plan different numbers of micro-batches
(one example: 4 and 3). Anything that runs a collective in every forward (FP8's amax all-reduce
over the data-parallel group, expert-parallel dispatch, context parallelism) then waits forever on
the rank with fewer. :func:`pad_micro_batches` evens the counts with micro-batches that run a
forward (and backward) but hold no response: they add nothing to any numerator, denominator,
metric or written-back output (docs/pitfalls.md#equal-pass-counts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_sspo.algorithms.batch import PolicyBatch

__all__ = ["MicroBatch", "MicroBatchLayout", "balanced_partition", "empty_micro_batch",
           "packed_positions", "pad_micro_batches"]


@dataclass
class MicroBatch:
    """One micro-batch: the model's input rows and the loss fields of the responses in them.

    Attributes:
        batch: the responses of this micro-batch, ``[b, S_b]`` target frame (one response per row,
            trimmed to the longest), read by the loss.
        rows: ``[b]`` int64 rows of the step's batch (where outputs are written back).
        input_ids: ``[R, S_in]`` int64 model input (``batch.input_ids`` unless packed).
        position_ids: ``[R, S_in]`` int64 ``arange(S_in)`` per row; for a packed row, positions that
            restart at 0 at every sequence (:func:`packed_positions`), the positions each sequence
            has alone. Row positions would be exact only in real arithmetic: the fp32 rotary angle
            of position ``p`` carries an error that grows with ``p``.
        sequence_lengths: ``[K]`` int64 lengths of the sequences laid end to end in the single
            packed row, or None (one sequence per row, causal attention).
        token_index: ``[b, S_b]`` int64 flat index into the model output ``[R * S_in]`` of each
            target position (0 where ``batch.loss_mask`` is False), or None (the output rows are
            ``batch``'s rows).
    """

    batch: PolicyBatch
    rows: torch.Tensor
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    sequence_lengths: torch.Tensor | None = None
    token_index: torch.Tensor | None = None


def empty_micro_batch(like: MicroBatch) -> MicroBatch:
    """A micro-batch that runs ``like``'s model input but holds no response.

    The loss sees a ``[0, S_b]`` batch, so its numerator, denominator and every metric count are
    0 (and so is every gradient: the loss reads no output position); ``rows`` is empty, so a
    forward-only pass writes nothing back. ``token_index`` ``[0, S_b]`` selects no output row,
    whatever ``like``'s input shape. The input is ``like``'s own (same shape, same packing), so a
    forward that needs aligned shapes (FP8, the THD layout) runs as it does for ``like``.

    Args:
        like: a planned micro-batch of this rank.

    Returns:
        A :class:`MicroBatch` sharing ``like``'s ``input_ids``, ``position_ids`` and
        ``sequence_lengths``.
    """
    none = torch.zeros(0, dtype=torch.long)
    width = like.batch.loss_mask.shape[1]
    return MicroBatch(like.batch.select(none), none, like.input_ids, like.position_ids,
                      like.sequence_lengths, torch.zeros(0, width, dtype=torch.long))


def pad_micro_batches(micro_batches: list[MicroBatch], count: int) -> list[MicroBatch]:
    """``micro_batches`` followed by empty ones up to ``count`` in all.

    Each added one is :func:`empty_micro_batch` of the micro-batch with the fewest input tokens.

    Args:
        micro_batches: this rank's planned micro-batches, at least one.
        count: the number of passes every data-parallel rank runs (the ranks' maximum).

    Returns:
        ``count`` micro-batches; the first ones are ``micro_batches`` unchanged.

    Raises:
        ValueError: no micro-batch to copy an input from, or ``count`` below the planned number.
    """
    if not micro_batches or count < len(micro_batches):
        raise ValueError(f"cannot pad {len(micro_batches)} planned micro-batches to count={count}: "
                         "need at least one micro-batch and count >= their number")
    cheapest = min(micro_batches, key=lambda micro: micro.input_ids.numel())
    return micro_batches + [empty_micro_batch(cheapest)] * (count - len(micro_batches))


def _fixed(batch: PolicyBatch, micro_batch_size: int) -> list[MicroBatch]:
    total = batch.input_ids.shape[0]
    if total % micro_batch_size:
        raise ValueError(f"batch of {total} rows does not split into micro-batches of "
                         f"{micro_batch_size}")
    out = []
    for start in range(0, total, micro_batch_size):
        rows = torch.arange(start, start + micro_batch_size)
        part = batch.select(rows)
        out.append(MicroBatch(part, rows, part.input_ids, part.position_ids))
    return out


def _budget_groups(lengths: torch.Tensor, max_tokens: int, cost) -> list[list[int]]:
    """Rows (longest first) cut greedily into groups whose ``cost(group lengths)`` fits the budget."""
    order = sorted(range(len(lengths)), key=lambda r: (-int(lengths[r]), r))
    groups: list[list[int]] = []
    for row in order:
        if groups and cost([int(lengths[r]) for r in groups[-1]] + [int(lengths[row])]) <= max_tokens:
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


def _packed_bins(lengths: torch.Tensor, max_tokens: int) -> list[list[int]]:
    """First-fit decreasing: each sequence goes into the first row with room for it."""
    bins: list[list[int]] = []
    room: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda r: (-int(lengths[r]), r)):
        length = int(lengths[row])
        slot = next((i for i, free in enumerate(room) if free >= length), None)
        if slot is None:
            bins.append([row])
            room.append(max_tokens - length)
        else:
            bins[slot].append(row)
            room[slot] -= length
    return [sorted(b) for b in bins]


def balanced_partition(lengths: list[int], parts: int) -> list[list[int]]:
    """Splits rows into ``parts`` groups of equal row count and about equal total length (tokens).

    Longest-processing-time-first with a cardinality limit (Graham 1969 without the limit):
    rows taken longest first (ties: lower index) each go to the group with the smallest total so
    far among those with fewer than ``len(lengths) / parts`` rows (ties: lower group). Equal row
    counts keep every data-parallel rank's mini-batches the same size. Deterministic, so every rank
    that computes it from the same lengths gets the same answer.

    Args:
        lengths: tokens of each row (prompt + response), ``>= 0``.
        parts: number of groups, ``>= 1`` (the data-parallel size).

    Returns:
        ``parts`` lists of ``len(lengths) / parts`` row indices, each ascending; every row is in
        exactly one.

    Raises:
        ValueError: ``parts < 1``, or a row count that ``parts`` does not divide.
    """
    if parts < 1 or len(lengths) % parts:
        raise ValueError(f"{len(lengths)} rows do not split into {parts} groups of equal size "
                         "(parts must be >= 1 and divide the row count)")
    room = len(lengths) // parts
    groups: list[list[int]] = [[] for _ in range(parts)]
    totals = [0] * parts
    for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        target = min((g for g in range(parts) if len(groups[g]) < room), key=lambda g: (totals[g], g))
        groups[target].append(row)
        totals[target] += lengths[row]
    return [sorted(g) for g in groups]


def _padded_group(batch: PolicyBatch, rows: list[int], lengths: torch.Tensor) -> MicroBatch:
    index = torch.tensor(rows, dtype=torch.long)
    part = batch.select(index).narrow(int(lengths[index].max()))
    return MicroBatch(part, index, part.input_ids, part.position_ids)


def packed_positions(sequence_lengths: torch.Tensor) -> torch.Tensor:
    """Positions of sequences laid end to end, restarting at 0 at each one.

    Args:
        sequence_lengths: ``[K]`` int64 lengths, each >= 0.

    Returns:
        ``[sum(lengths)]`` int64 on the lengths' device, e.g. lengths ``[2, 3]`` ->
        ``[0, 1, 0, 1, 2]``.
    """
    starts = torch.cumsum(sequence_lengths, 0) - sequence_lengths
    total = int(sequence_lengths.sum())
    return (torch.arange(total, device=sequence_lengths.device)
            - torch.repeat_interleave(starts, sequence_lengths, output_size=total))


def _packed_group(batch: PolicyBatch, rows: list[int], lengths: torch.Tensor) -> MicroBatch:
    index = torch.tensor(rows, dtype=torch.long)
    seq_lengths = lengths[index]
    part = batch.select(index).narrow(int(seq_lengths.max()))
    offsets = torch.cumsum(seq_lengths, 0) - seq_lengths
    valid = torch.arange(part.input_ids.shape[1])[None, :] < seq_lengths[:, None]
    input_ids = part.input_ids[valid][None, :]  # row-major: the sequences end to end
    token_index = torch.where(part.loss_mask, offsets[:, None] + torch.arange(part.input_ids.shape[1]),
                              torch.zeros((), dtype=torch.long))
    return MicroBatch(part, index, input_ids, packed_positions(seq_lengths)[None, :], seq_lengths,
                      token_index)


@dataclass(frozen=True)
class MicroBatchLayout:
    """How to cut a batch into micro-batches (module docstring for the three layouts).

    Attributes:
        micro_batch_size: rows per micro-batch of the fixed layout (read when ``max_tokens`` is
            None).
        max_tokens: token budget per micro-batch: padded rows x width (``pack=False``) or the
            packed row's width (``pack=True``); None for the fixed layout.
        pack: lay sequences end to end in one row per micro-batch (needs ``max_tokens``).

    Raises:
        ValueError: on construction, neither or both sizes, sizes below 1, or a non-bool
            ``pack`` (True needs ``max_tokens``).
    """

    micro_batch_size: int | None = None
    max_tokens: int | None = None
    pack: bool = False

    def __post_init__(self) -> None:
        if (self.max_tokens is None) == (self.micro_batch_size is None):
            raise ValueError("give exactly one of micro_batch_size (fixed rows) and max_tokens "
                             "(token budget), got "
                             f"micro_batch_size={self.micro_batch_size}, max_tokens={self.max_tokens}")
        if not isinstance(self.pack, bool) or (self.pack and self.max_tokens is None):
            raise ValueError(f"pack={self.pack!r} must be a bool, and True needs max_tokens")
        for name in ("micro_batch_size", "max_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be an int >= 1 or None")

    @property
    def fixed(self) -> bool:
        """Every micro-batch has the same shape (what the default pipeline schedule needs)."""
        return self.max_tokens is None

    def plan(self, batch: PolicyBatch) -> list[MicroBatch]:
        """Split ``batch`` (``[B, S]``, with ``lengths`` when right-padded) into micro-batches;
        every row is in exactly one.

        Raises:
            ValueError: rows that do not split into ``micro_batch_size``, or a sequence longer
                than ``max_tokens`` (names the length and the setting).
        """
        if self.fixed:
            return _fixed(batch, self.micro_batch_size)
        lengths = batch.row_lengths()
        longest = int(lengths.max())
        if longest > self.max_tokens:
            raise ValueError(f"a sequence of {longest} tokens does not fit "
                             f"parallel.max_tokens_per_micro_batch={self.max_tokens}; raise it to "
                             "at least the longest prompt + response (prompts come from the data: "
                             "allow its longest prompt plus rollout.sampling.max_new_tokens)")
        if self.pack:
            return [_packed_group(batch, rows, lengths)
                    for rows in _packed_bins(lengths, self.max_tokens)]
        groups = _budget_groups(lengths, self.max_tokens, lambda ls: len(ls) * max(ls))
        return [_padded_group(batch, rows, lengths) for rows in groups]
