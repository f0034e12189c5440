"""Rows balanced by tokens across data-parallel ranks, over real gloo process groups.

Each rank holds rows whose token values say where they came from (``100 * rank + row``), so the
rows each rank ends with can be compared with the partition worked out by hand.
"""

from __future__ import annotations

import pytest
import torch

from nemo_sspo.algorithms.batch import PolicyBatch

pytestmark = pytest.mark.fast  # seconds: kept in the fast tier (tests/conftest.py)

# lengths (prompt + response tokens) of each rank's rows, per world size
LENGTHS = {
    2: [[9, 8, 7, 6], [2, 2, 1, 1]],
    3: [[10, 1], [4, 4], [3, 3]],
}
# Longest first onto the lightest rank with room (ties: lower global row, then lower rank; every
# rank ends with the mean row count), worked by hand.
# world 2: 9 -> A, 8 -> B, 7 -> B (8 < 9), 6 -> A (9 < 15), 2 -> A (15 = 15), 2 -> B, 1 -> A, 1 -> B:
#          totals 18 and 18 (before: 30 and 6).
# world 3 (2 rows each): 10 -> A, 4 -> B, 4 -> C, 3 -> B (4 = 4), 3 -> C, and B and C are full, so
#          1 -> A: totals 11, 7, 7 (before: 11, 8, 6).
# Rows as (source rank, row), in the order a rank receives them (by source rank, then row).
EXPECTED = {
    2: [[(0, 0), (0, 3), (1, 0), (1, 2)], [(0, 1), (0, 2), (1, 1), (1, 3)]],
    3: [[(0, 0), (0, 1)], [(1, 0), (2, 0)], [(1, 1), (2, 1)]],
}


def _rank_batch(rank: int, lengths: list[int]) -> PolicyBatch:
    rows, width = len(lengths), max(lengths) + rank  # widths differ between ranks on purpose
    valid = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    tags = torch.tensor([100 * rank + row for row in range(rows)])
    ids = torch.where(valid, tags[:, None], 0)
    loss_mask = valid.clone()
    loss_mask[:, 0] = False
    return PolicyBatch(
        input_ids=ids, position_ids=torch.arange(width).expand(rows, width).contiguous(),
        targets=ids.clone(), loss_mask=loss_mask,
        segment_ids=torch.where(loss_mask, 0, -1), old_logprobs=-loss_mask.float(),
        old_entropy=loss_mask.float(), advantages=tags.float(),
        tis_weights=torch.where(loss_mask, 0.5, 1.0), lengths=torch.tensor(lengths))


def _balance(rank, world_size):
    import torch.distributed as dist

    from nemo_sspo.parallel.data_balance import balance_across_data_parallel

    mine = _rank_batch(rank, LENGTHS[world_size][rank])
    return balance_across_data_parallel(mine, dist.group.WORLD)


def test_rows_move_to_the_hand_worked_partition(run_distributed):
    for world, expected in EXPECTED.items():
        results = run_distributed(_balance, world)
        for rank, got in enumerate(results):
            tags = [(int(t) // 100, int(t) % 100) for t in got.advantages]
            assert tags == expected[rank]
            lengths = [LENGTHS[world][src][row] for src, row in tags]
            assert got.lengths.tolist() == lengths
            width = max(lengths)  # each part is cut to its longest row, then padded to the longest
            assert got.input_ids.shape == (len(tags), width)
            assert torch.equal(got.position_ids, torch.arange(width).expand(len(tags), width))
            for i, ((src, row), length) in enumerate(zip(tags, lengths)):
                tag = 100 * src + row
                assert got.input_ids[i, :length].eq(tag).all() and got.input_ids[i, length:].eq(0).all()
                assert got.loss_mask[i].sum() == length - 1 and not got.loss_mask[i, length:].any()
                # padding as pack_rollouts writes it: segment -1, TIS weight 1, log-probs 0
                assert got.segment_ids[i, length:].eq(-1).all() and got.tis_weights[i, length:].eq(1).all()
                assert got.tis_weights[i, 1:length].eq(0.5).all()
                assert got.old_logprobs[i, 1:length].eq(-1).all() and got.old_logprobs[i, length:].eq(0).all()


def test_one_rank_gets_its_batch_back():
    from nemo_sspo.parallel.data_balance import balance_across_data_parallel

    batch = _rank_batch(0, [3, 2])
    assert balance_across_data_parallel(batch, None) is batch
