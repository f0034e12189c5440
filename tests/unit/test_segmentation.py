"""Line-break segmentation: boundary table from real tokenizers, segment ids, ratio levels."""

import pytest
import torch

from nemo_sspo.algorithms.segmentation import (
    build_boundary_table,
    newline_segment_ids,
    segment_ids_for_level,
)


@pytest.fixture(scope="module")
def qwen_boundary(qwen_tokenizer):
    return build_boundary_table(qwen_tokenizer)


def _segments_of_text(tokenizer, boundary, text):
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    ids_t = torch.tensor([ids])
    seg = newline_segment_ids(ids_t, torch.ones_like(ids_t, dtype=torch.bool), boundary)
    return ids, seg[0].tolist()


def test_boundary_table_covers_vocab_and_merged_tokens(qwen_tokenizer, qwen_boundary):
    assert qwen_boundary.dtype == torch.bool
    assert qwen_boundary.shape == (qwen_tokenizer.get_vocab_size(),)
    newline_id = qwen_tokenizer.encode("\n", add_special_tokens=False).ids
    assert len(newline_id) == 1 and bool(qwen_boundary[newline_id[0]])
    # BPE merges: many more ids than the single "\n" token contain a newline (docs/pitfalls.md#p18).
    assert int(qwen_boundary.sum()) > 100
    step_id = qwen_tokenizer.encode("Step", add_special_tokens=False).ids[0]
    assert not bool(qwen_boundary[step_id])


def test_qwen_period_double_newline_closes_segment(qwen_tokenizer, qwen_boundary):
    # docs/pitfalls.md#p18: "Step 1.\n\nStep 2." -> Step | ' ' | 1 | '.\n\n' (id 382) || Step | ' ' | 2 | '.'
    ids, seg = _segments_of_text(qwen_tokenizer, qwen_boundary, "Step 1.\n\nStep 2.")
    pieces = [qwen_tokenizer.decode([i]) for i in ids]
    assert pieces == ["Step", " ", "1", ".\n\n", "Step", " ", "2", "."]
    assert ids[3] == 382
    assert seg == [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize(
    ("text", "merged", "first_line"),
    [("Solve:\n\nx = 2", ":\n\n", "Solve:\n\n"), ("f(x)\ny = 1", ")\n", "f(x)\n")],
)
def test_qwen_merged_newline_tokens(qwen_tokenizer, qwen_boundary, text, merged, first_line):
    ids, seg = _segments_of_text(qwen_tokenizer, qwen_boundary, text)
    pieces = [qwen_tokenizer.decode([i]) for i in ids]
    assert merged in pieces  # the tokenizer really merges the newline with its neighbour
    close = pieces.index(merged)
    assert bool(qwen_boundary[ids[close]])
    # The merged token closes segment 0; everything after it is segment 1.
    assert seg == [0] * (close + 1) + [1] * (len(ids) - close - 1)
    assert qwen_tokenizer.decode(ids[: close + 1]) == first_line


def test_smollm2_three_lines_give_three_segments(smollm2_tokenizer):
    boundary = build_boundary_table(smollm2_tokenizer)
    assert boundary.shape == (len(smollm2_tokenizer),)
    text = "First line here\nsecond line\nthird line"
    ids = torch.tensor([smollm2_tokenizer.encode(text, add_special_tokens=False)])
    seg = newline_segment_ids(ids, torch.ones_like(ids, dtype=torch.bool), boundary)[0]
    assert int(seg.max()) + 1 == 3
    lines = [smollm2_tokenizer.decode(ids[0][seg == j].tolist()) for j in range(3)]
    assert lines == ["First line here\n", "second line\n", "third line"]


def test_newline_segment_ids_hand_table():
    # Vocabulary of 5 ids, id 2 is a boundary. Row 0: 1 2 | 3 2 | (pad); row 1: 2 | 1 (pads).
    boundary = torch.tensor([False, False, True, False, False])
    ids = torch.tensor([[1, 2, 3, 2, 4], [2, 1, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    seg = newline_segment_ids(ids, mask, boundary)
    assert seg.tolist() == [[0, 0, 1, 1, -1], [0, 1, -1, -1, -1]]
    assert seg.dtype == torch.int64


def test_masked_positions_neither_split_nor_validate():
    # A masked boundary id (2) in the middle does not split; masked pad id -100 is never looked up.
    boundary = torch.tensor([False, False, True])
    ids = torch.tensor([[1, 2, 1, 2, -100]])
    mask = torch.tensor([[1, 0, 1, 1, 0]], dtype=torch.bool)
    assert newline_segment_ids(ids, mask, boundary).tolist() == [[0, -1, 0, 0, -1]]


def test_all_masked_row_is_all_minus_one():
    boundary = torch.tensor([False, True])
    ids = torch.tensor([[0, 1, 0], [1, 1, 0]])
    mask = torch.tensor([[0, 0, 0], [1, 1, 1]], dtype=torch.bool)
    assert newline_segment_ids(ids, mask, boundary).tolist() == [[-1, -1, -1], [0, 1, 2]]


def test_out_of_vocab_id_raises():
    boundary = torch.tensor([False, True])
    ids = torch.tensor([[0, 2]])
    with pytest.raises(ValueError, match="boundary table"):
        newline_segment_ids(ids, torch.ones_like(ids, dtype=torch.bool), boundary)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match=r"\(1, 3\).*\(1, 2\)"):
        newline_segment_ids(
            torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool),
            torch.tensor([True]),
        )


def test_segment_ids_for_level():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    newline = torch.tensor([[0, 0, 1, 7], [0, 5, 5, 5]])
    assert segment_ids_for_level("token", mask).tolist() == [[0, 1, 2, -1], [0, -1, -1, -1]]
    assert segment_ids_for_level("sequence", mask).tolist() == [[0, 0, 0, -1], [0, -1, -1, -1]]
    # Subsentence level reuses the newline ids and forces -1 on masked positions.
    assert segment_ids_for_level("subsentence", mask, newline).tolist() == [
        [0, 0, 1, -1], [0, -1, -1, -1]
    ]


def test_segment_ids_for_level_errors():
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="newline_segment_ids"):
        segment_ids_for_level("subsentence", mask)
    with pytest.raises(ValueError, match="valid levels"):
        segment_ids_for_level("paragraph", mask)
    with pytest.raises(ValueError, match=r"\(1, 3\).*\(1, 2\)"):
        segment_ids_for_level("subsentence", mask, torch.zeros(1, 3, dtype=torch.long))
