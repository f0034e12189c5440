"""Megatron's load-balanced context-parallel split (nemo_sspo.parallel.context_parallel) against
hand-worked indices and against megatron-core's own ``get_batch_on_this_cp_rank``."""

from __future__ import annotations

import pytest
import torch

from nemo_sspo.parallel.context_parallel import cp_padded_width, split_sequence, zigzag_positions


def test_hand_worked_positions():
    # S = 8, CP = 2: 4 chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    # S = 16, CP = 4: 8 chunks of 2; rank r holds chunks r and 7 - r.
    assert zigzag_positions(16, 4, 0).tolist() == [0, 1, 14, 15]
    assert zigzag_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    assert zigzag_positions(16, 4, 2).tolist() == [4, 5, 10, 11]
    assert zigzag_positions(16, 4, 3).tolist() == [6, 7, 8, 9]
    assert zigzag_positions(5, 1, 0).tolist() == [0, 1, 2, 3, 4]


def test_split_takes_the_columns_and_the_ranks_cover_the_row_once():
    row = torch.arange(8).repeat(3, 1) * 10
    assert split_sequence(row, 2, 1).tolist() == [[20, 30, 40, 50]] * 3
    covered = torch.cat([zigzag_positions(24, 3, r) for r in range(3)])
    assert sorted(covered.tolist()) == list(range(24))


def test_width_must_split_into_two_chunks_per_rank():
    assert cp_padded_width(10, 2) == 12 and cp_padded_width(12, 2) == 12 and cp_padded_width(1, 3) == 6
    with pytest.raises(ValueError, match="10 positions does not split into 2 x context_parallel_size = 4 .* pad it to 12"):
        zigzag_positions(10, 2, 0)
    with pytest.raises(ValueError, match="cp_rank=2"):
        zigzag_positions(8, 2, 2)


class _Group:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def test_same_split_as_megatron_core(monkeypatch):
    from megatron.core import utils as mcore_utils

    monkeypatch.setattr(mcore_utils.torch.distributed, "is_initialized", lambda: True)
    width = 24
    values = torch.arange(2 * width).reshape(2, width)
    for size in (2, 3):
        for rank in range(size):
            theirs = mcore_utils.get_batch_on_this_cp_rank({"tokens": values.clone()}, _Group(size, rank))
            assert torch.equal(split_sequence(values, size, rank), theirs["tokens"]), (size, rank)
