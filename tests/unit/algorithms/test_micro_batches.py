"""Micro-batch layouts worked by hand: fixed rows, token budget, packed sequences (first-fit
decreasing), the packed row's token index, and the packed attention mask."""

import pytest
import torch

from nemo_sspo.algorithms.batch import pack_rollouts
from nemo_sspo.algorithms.micro_batches import MicroBatchLayout, pad_micro_batches
from nemo_sspo.megatron.cpu_shims import attention_mask_for

# Prompt + response lengths [3 + 5, 2 + 3, 4 + 4, 2 + 1, 3 + 0] = [8, 5, 8, 3, 3].
PROMPTS, RESPONSES = [3, 2, 4, 2, 3], [5, 3, 4, 1, 0]


def _batch():
    rows, p_max, t_max = len(PROMPTS), max(PROMPTS), max(RESPONSES)
    prompt_ids = torch.zeros(rows, p_max, dtype=torch.long)
    prompt_mask = torch.zeros(rows, p_max, dtype=torch.bool)
    response_ids = torch.zeros(rows, t_max, dtype=torch.long)
    response_mask = torch.zeros(rows, t_max, dtype=torch.bool)
    for b, (p, t) in enumerate(zip(PROMPTS, RESPONSES)):
        # token value 10 * row + position, so every token says where it came from
        prompt_ids[b, p_max - p:] = 10 * b + torch.arange(p) + 1
        prompt_mask[b, p_max - p:] = True
        response_ids[b, :t] = 10 * b + p + torch.arange(t) + 1
        response_mask[b, :t] = True
    segments = torch.where(response_mask, 0, -1)
    return pack_rollouts(prompt_ids, prompt_mask, response_ids, response_mask, segments,
                         torch.arange(rows, dtype=torch.float32), pad_id=0)


def test_lengths_and_fixed_rows():
    batch = _batch()
    assert batch.lengths.tolist() == [8, 5, 8, 3, 3]
    with pytest.raises(ValueError, match="does not split into micro-batches of 2"):
        MicroBatchLayout(micro_batch_size=2).plan(batch)
    parts = MicroBatchLayout(micro_batch_size=5).plan(batch)
    assert len(parts) == 1 and parts[0].rows.tolist() == [0, 1, 2, 3, 4]
    assert parts[0].input_ids.shape == (5, 8) and parts[0].token_index is None


def test_token_budget_groups_rows_by_length():
    # Longest first: 8 (row 0), 8 (row 2), 5 (row 1), 3 (row 3), 3 (row 4). Budget 16 padded tokens:
    # [0, 2] = 2 x 8 = 16; adding row 1 would cost 3 x 8 = 24 > 16, so [1, 3, 4] = 3 x 5 = 15.
    parts = MicroBatchLayout(max_tokens=16).plan(_batch())
    assert [p.rows.tolist() for p in parts] == [[0, 2], [1, 3, 4]]
    assert [tuple(p.input_ids.shape) for p in parts] == [(2, 8), (3, 5)]  # each trimmed to its longest
    # Row 1 keeps its tokens (prompt 11 12, response 13 14 15), trimmed to 5 columns.
    assert parts[1].input_ids[0].tolist() == [11, 12, 13, 14, 15]


def test_packing_first_fit_decreasing_and_token_index():
    # Width 11: 8 (row 0) -> bin A (room 3); 8 (row 2) -> bin B (room 3); 5 (row 1) -> bin C (room
    # 6); 3 (row 3) -> A (full, ends at the boundary); 3 (row 4) -> B (full). Bins by row order.
    parts = MicroBatchLayout(max_tokens=11, pack=True).plan(_batch())
    assert [p.rows.tolist() for p in parts] == [[0, 3], [2, 4], [1]]
    assert [p.sequence_lengths.tolist() for p in parts] == [[8, 3], [8, 3], [5]]
    first = parts[0]
    # Row 0's 8 tokens then row 3's 3 tokens (31 32 33), end to end.
    assert first.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 31, 32, 33]]
    # Positions restart at each sequence: 0..7 for row 0, then 0..2 for row 3 (as each alone).
    assert first.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2]]
    # Row 0: prompt 3 -> targets at columns 2..6 (predicting its 5 response tokens), packed at the
    # same positions. Row 3 starts at offset 8: prompt 2 -> target column 1 -> packed position 9.
    mask = first.batch.loss_mask
    assert first.token_index[mask].tolist() == [2, 3, 4, 5, 6, 9]
    flat_targets = torch.cat([first.input_ids[0, 1:], torch.zeros(1, dtype=torch.long)])
    assert torch.equal(flat_targets[first.token_index[mask]], first.batch.targets[mask])


@pytest.mark.parametrize("pack", [False, True])
def test_padding_adds_passes_that_hold_no_response(pack):
    # Budget 16 plans [0, 2] (2 x 8) and [1, 3, 4] (3 x 5); packed into rows of 11: [0, 3] [2, 4]
    # [1]. Padded to 4 passes, the extra ones run the cheapest input (15 and 5 tokens) and carry
    # no rows and no loss positions.
    layout = MicroBatchLayout(max_tokens=11 if pack else 16, pack=pack)
    planned = layout.plan(_batch())
    padded = pad_micro_batches(planned, 4)
    assert padded[: len(planned)] == planned and len(padded) == 4
    cheapest = planned[-1]
    assert cheapest.input_ids.numel() == (5 if pack else 15)
    for extra in padded[len(planned):]:
        assert extra.input_ids is cheapest.input_ids and extra.position_ids is cheapest.position_ids
        assert extra.sequence_lengths is cheapest.sequence_lengths
        assert extra.rows.numel() == 0 and extra.batch.input_ids.shape == (0, cheapest.batch.input_ids.shape[1])
        assert extra.token_index.shape == (0, cheapest.batch.loss_mask.shape[1])
    assert pad_micro_batches(planned, len(planned)) == planned
    with pytest.raises(ValueError, match="count=1"):
        pad_micro_batches(planned, 1)


def test_sequence_longer_than_the_budget_is_refused():
    with pytest.raises(ValueError, match="sequence of 8 tokens does not fit .*max_tokens_per_micro_batch=7"):
        MicroBatchLayout(max_tokens=7, pack=True).plan(_batch())
    with pytest.raises(ValueError, match="pack=True"):
        MicroBatchLayout(micro_batch_size=2, pack=True)
    with pytest.raises(ValueError, match="max_tokens=0"):
        MicroBatchLayout(max_tokens=0)


def test_packed_attention_mask_confines_each_sequence():
    # Lengths [2, 3] in a row of 5: causal within [0, 1] and within [2, 4], nothing across.
    mask = attention_mask_for(5, torch.device("cpu"), torch.tensor([2, 3]))[0, 0]
    allowed = (~mask).int().tolist()
    assert allowed == [[1, 0, 0, 0, 0],
                       [1, 1, 0, 0, 0],
                       [0, 0, 1, 0, 0],
                       [0, 0, 1, 1, 0],
                       [0, 0, 1, 1, 1]]


@pytest.mark.parametrize("overrides, message", [
    (["parallel.pack_sequences=true"], r"pack_sequences=true needs parallel\.max_tokens_per_micro_batch"),
    (["parallel.max_tokens_per_micro_batch=32"], r"max_tokens_per_micro_batch=32 must exceed rollout\.sampling\.max_new_tokens=64"),
    (["parallel.max_tokens_per_micro_batch=0"], r"parallel\.max_tokens_per_micro_batch=0 must be >= 1"),
    (["parallel.output_chunk_size=0"], r"parallel\.output_chunk_size must be >= 1, or null"),
])
def test_layout_settings_fail_at_load_naming_the_key(overrides, message):
    from nemo_sspo.cli import load_config

    with pytest.raises(ValueError, match=message):
        load_config(overrides=overrides)


def test_layout_from_config():
    from nemo_sspo.cli import load_config
    from nemo_sspo.trainer.config import micro_batch_layout

    cfg = load_config(overrides=["parallel.max_tokens_per_micro_batch=600", "parallel.pack_sequences=true"])
    assert micro_batch_layout(cfg.parallel) == MicroBatchLayout(max_tokens=600, pack=True)
    assert micro_batch_layout(load_config().parallel) == MicroBatchLayout(micro_batch_size=4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(micro_batch_size=2, max_tokens=100), "exactly one of micro_batch_size"),
    (dict(), "exactly one of micro_batch_size"),
    (dict(max_tokens=100, pack="yes"), "pack='yes' must be a bool"),
])
def test_layout_arguments_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MicroBatchLayout(**kwargs)


def test_balanced_partition_longest_first_onto_the_lightest_group_with_room():
    from nemo_sspo.algorithms.micro_batches import balanced_partition

    # 9 -> 0, 8 -> 1, 7 -> 1 (8 < 9), 6 -> 0 (9 < 15), 2 -> 0 (15 = 15), 2 -> 1, 1 -> 0, 1 -> 1
    assert balanced_partition([2, 9, 1, 8, 7, 2, 6, 1], 2) == [[0, 1, 2, 6], [3, 4, 5, 7]]
    # rows 1, 3, 2, 0, 4, 5: 5 -> 0, 5 -> 1, 4 -> 2, 3 -> 2 (4 < 5; now full), 3 -> 0 (5 = 5, lower
    # group; full), 1 -> 1
    assert balanced_partition([3, 5, 4, 5, 3, 1], 3) == [[1, 4], [3, 5], [0, 2]]
    # 10 -> 0, 1 -> 1, 1 -> 1 (full at 2 rows), 1 -> 0 although group 1 is lighter
    assert balanced_partition([10, 1, 1, 1], 2) == [[0, 3], [1, 2]]
    for lengths, parts in (([1, 2, 3], 2), ([1, 2], 0)):
        with pytest.raises(ValueError, match="do not split into"):
            balanced_partition(lengths, parts)
