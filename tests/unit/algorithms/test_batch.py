"""Packing rollouts into the target frame, checked against hand-built layouts."""

from dataclasses import replace

import pytest
import torch

from nemo_sspo.algorithms.batch import PolicyBatch, concat_policy_batches, pack_rollouts

PAD = 0


def test_pack_rollouts_hand_layout():
    # Row 0: prompt [5, 6] (left-padded to 3), response [7, 8, 9].
    # Row 1: prompt [4, 5, 6], response [3] then padding; row 2: prompt [1], empty response.
    prompt_ids = torch.tensor([[PAD, 5, 6], [4, 5, 6], [PAD, PAD, 1]])
    prompt_mask = prompt_ids != PAD
    response_ids = torch.tensor([[7, 8, 9], [3, PAD, PAD], [PAD, PAD, PAD]])
    response_mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    segments = torch.tensor([[0, 0, 1], [0, -1, -1], [-1, -1, -1]])
    adv = torch.tensor([1.0, -1.0, 0.0])

    b = pack_rollouts(prompt_ids, prompt_mask, response_ids, response_mask, segments, adv, pad_id=PAD)

    # S = max(2 + 3, 3 + 1, 1 + 0) = 5
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9], [4, 5, 6, 3, PAD], [1, PAD, PAD, PAD, PAD]]
    assert b.targets.tolist() == [[6, 7, 8, 9, PAD], [5, 6, 3, PAD, PAD], [PAD] * 5]
    # Response token t of a row with prompt length P is predicted at column P - 1 + t.
    assert b.loss_mask.tolist() == [
        [False, True, True, True, False],
        [False, False, True, False, False],
        [False] * 5,
    ]
    assert b.segment_ids.tolist() == [[-1, 0, 0, 1, -1], [-1, -1, 0, -1, -1], [-1] * 5]
    assert b.position_ids.tolist() == [list(range(5))] * 3
    assert torch.equal(b.targets[b.loss_mask], response_ids[response_mask])
    assert b.advantages.tolist() == [1.0, -1.0, 0.0]


def test_from_rollout_places_engine_logprobs_at_the_target_columns():
    # The layout of test_pack_rollouts_hand_layout; engine log-probs of the sampled tokens
    # (response frame): row 0 [-0.1, -0.2, -0.3], row 1 [-0.4, pad, pad], row 2 empty. Response
    # token t of a row with prompt length P sits at target column P - 1 + t: row 0 (P = 2) at
    # columns 1, 2, 3; row 1 (P = 3) at column 2; 0 elsewhere.
    from nemo_sspo.rollout import RolloutBatch

    prompt_ids = torch.tensor([[PAD, 5, 6], [4, 5, 6], [PAD, PAD, 1]])
    response_ids = torch.tensor([[7, 8, 9], [3, PAD, PAD], [PAD, PAD, PAD]])
    response_mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    engine = torch.tensor([[-0.1, -0.2, -0.3], [-0.4, 9.0, 9.0], [9.0, 9.0, 9.0]])
    rollout = RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_ids != PAD, response_ids=response_ids,
                           response_mask=response_mask, truncated=torch.zeros(3, dtype=torch.bool),
                           response_texts=["", "", ""], rollout_logprobs=torch.where(response_mask, engine, 0.0))
    segments = torch.tensor([[0, 0, 1], [0, -1, -1], [-1, -1, -1]])
    b = PolicyBatch.from_rollout(rollout, segments, torch.tensor([1.0, -1.0, 0.0]), pad_id=PAD)
    expected = torch.tensor([[0, -0.1, -0.2, -0.3, 0], [0, 0, -0.4, 0, 0], [0] * 5])
    assert torch.equal(b.rollout_logprobs, expected)
    assert b.loss_mask.tolist() == [[False, True, True, True, False], [False, False, True, False, False],
                                    [False] * 5]


def test_concat_rollouts_pads_prompts_left_and_responses_right():
    from nemo_sspo.rollout import RolloutBatch
    from nemo_sspo.rollouts.slots import concat_rollouts

    a = RolloutBatch(prompt_ids=torch.tensor([[5, 6]]), prompt_mask=torch.tensor([[True, True]]),
                     response_ids=torch.tensor([[7]]), response_mask=torch.tensor([[True]]),
                     truncated=torch.tensor([True]), response_texts=["x"],
                     rollout_logprobs=torch.tensor([[-0.5]]))
    b = RolloutBatch(prompt_ids=torch.tensor([[4, 5, 6]]), prompt_mask=torch.tensor([[True, True, True]]),
                     response_ids=torch.tensor([[1, 2, 3]]), response_mask=torch.tensor([[True, True, False]]),
                     truncated=torch.tensor([False]), response_texts=["y"],
                     rollout_logprobs=torch.tensor([[-1.0, -2.0, 0.0]]))
    c = concat_rollouts([a, b], pad_id=PAD)
    assert c.prompt_ids.tolist() == [[PAD, 5, 6], [4, 5, 6]]
    assert c.prompt_mask.tolist() == [[False, True, True], [True, True, True]]
    assert c.response_ids.tolist() == [[7, PAD, PAD], [1, 2, 3]]
    assert c.response_mask.tolist() == [[True, False, False], [True, True, False]]
    assert c.rollout_logprobs.tolist() == [[-0.5, 0.0, 0.0], [-1.0, -2.0, 0.0]]
    assert c.truncated.tolist() == [True, False] and c.response_texts == ["x", "y"]


def test_concat_policy_batches_pads_as_pack_rollouts_and_narrow_drops_padding():
    def batch(rows, width, tag):
        full = torch.full((rows, width), tag)
        return PolicyBatch(input_ids=full.long(), position_ids=torch.arange(width).expand(rows, width),
                           targets=full.long(), loss_mask=torch.ones(rows, width, dtype=torch.bool),
                           segment_ids=torch.zeros(rows, width, dtype=torch.long),
                           old_logprobs=full.float(), old_entropy=full.float(),
                           advantages=torch.full((rows,), float(tag)),
                           tis_weights=torch.full((rows, width), 0.5), lengths=torch.full((rows,), width))

    merged = concat_policy_batches([batch(1, 2, 7), batch(2, 3, 8)])
    assert merged.input_ids.tolist() == [[7, 7, 0], [8, 8, 8], [8, 8, 8]]
    assert merged.position_ids.tolist() == [[0, 1, 2]] * 3
    assert merged.loss_mask.tolist() == [[True, True, False], [True] * 3, [True] * 3]
    assert merged.segment_ids[0].tolist() == [0, 0, -1] and merged.tis_weights[0].tolist() == [0.5, 0.5, 1.0]
    assert merged.old_logprobs[0].tolist() == [7.0, 7.0, 0.0] and merged.ref_logprobs is None
    assert merged.advantages.tolist() == [7.0, 8.0, 8.0] and merged.lengths.tolist() == [2, 3, 3]
    narrow = merged.narrow(2)
    assert narrow.input_ids.tolist() == [[7, 7], [8, 8], [8, 8]] and narrow.advantages.tolist() == [7.0, 8.0, 8.0]
    with pytest.raises(ValueError, match="ref_logprobs is set in some batches"):
        concat_policy_batches([batch(1, 2, 7), replace(batch(1, 2, 7), ref_logprobs=torch.zeros(1, 2))])


def test_concat_policy_batches_gives_lengths_when_rows_gain_padding():
    def batch(rows, width, lengths=None):
        ids = torch.ones(rows, width, dtype=torch.long)
        return PolicyBatch(input_ids=ids, position_ids=torch.arange(width).expand(rows, width), targets=ids,
                           loss_mask=ids.bool(), segment_ids=ids - 1, old_logprobs=ids.float(),
                           old_entropy=ids.float(), advantages=torch.zeros(rows), lengths=lengths)

    # lengths None means every position is valid: widths 2 and 3 pad the first part's row by one
    # column, so it needs lengths [2]; the second part's rows are full: [3, 3].
    assert concat_policy_batches([batch(1, 2), batch(2, 3)]).lengths.tolist() == [2, 3, 3]
    # one width and no lengths anywhere: nothing padded, lengths stays None
    assert concat_policy_batches([batch(1, 3), batch(2, 3)]).lengths is None
    # one width, one part with lengths: the other's rows are full (3)
    merged = concat_policy_batches([batch(1, 3, torch.tensor([2])), batch(1, 3)])
    assert merged.lengths.tolist() == [2, 3]
    assert batch(2, 4).row_lengths().tolist() == [4, 4] and batch(1, 4, torch.tensor([1])).row_lengths().tolist() == [1]
