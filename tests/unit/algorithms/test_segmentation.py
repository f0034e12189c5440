"""Line-break segmentation (``segment_ids("newline", ...)``): the newline table of real tokenizers,
hand-made vocabularies, masking, errors, and the mask-only units (``mask_segment_ids``)."""

import pytest
import torch

from nemo_sspo.algorithms.segmentation import build_segment_tables, mask_segment_ids, segment_ids


class _Vocabulary:
    """A tokenizer whose id i decodes to ``texts[i]`` (all build_segment_tables reads)."""

    def __init__(self, texts):
        self.texts = texts

    def __len__(self):
        return len(self.texts)

    def decode(self, ids):
        return "".join(self.texts[i] for i in ids)


def _tables(boundary_ids, size):
    """Tables of a ``size``-id vocabulary in which exactly ``boundary_ids`` contain a newline."""
    return build_segment_tables(_Vocabulary([f"t{i}\n" if i in boundary_ids else f"t{i}" for i in range(size)]))


def _newline(ids, mask, tables):
    return segment_ids("newline", ids, mask, tables)


@pytest.fixture(scope="module")
def qwen_tables(qwen_tokenizer):
    return build_segment_tables(qwen_tokenizer)


@pytest.fixture(scope="module")
def qwen_boundary(qwen_tables):
    return qwen_tables.newline


def _segments_of_text(tokenizer, tables, text):
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    ids_t = torch.tensor([ids])
    seg = _newline(ids_t, torch.ones_like(ids_t, dtype=torch.bool), tables)
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


def test_qwen_period_double_newline_closes_segment(qwen_tokenizer, qwen_tables):
    # docs/pitfalls.md#p18: "Step 1.\n\nStep 2." -> Step | ' ' | 1 | '.\n\n' (id 382) || Step | ' ' | 2 | '.'
    ids, seg = _segments_of_text(qwen_tokenizer, qwen_tables, "Step 1.\n\nStep 2.")
    pieces = [qwen_tokenizer.decode([i]) for i in ids]
    assert pieces == ["Step", " ", "1", ".\n\n", "Step", " ", "2", "."]
    assert ids[3] == 382
    assert seg == [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize(
    ("text", "merged", "first_line"),
    [("Solve:\n\nx = 2", ":\n\n", "Solve:\n\n"), ("f(x)\ny = 1", ")\n", "f(x)\n")],
)
def test_qwen_merged_newline_tokens(qwen_tokenizer, qwen_tables, qwen_boundary, text, merged, first_line):
    ids, seg = _segments_of_text(qwen_tokenizer, qwen_tables, text)
    pieces = [qwen_tokenizer.decode([i]) for i in ids]
    assert merged in pieces  # the tokenizer really merges the newline with its neighbour
    close = pieces.index(merged)
    assert bool(qwen_boundary[ids[close]])
    # The merged token closes segment 0; everything after it is segment 1.
    assert seg == [0] * (close + 1) + [1] * (len(ids) - close - 1)
    assert qwen_tokenizer.decode(ids[: close + 1]) == first_line


def test_smollm2_three_lines_give_three_segments(smollm2_tokenizer):
    tables = build_segment_tables(smollm2_tokenizer)
    assert tables.vocab_size == len(smollm2_tokenizer)
    text = "First line here\nsecond line\nthird line"
    ids = torch.tensor([smollm2_tokenizer.encode(text, add_special_tokens=False)])
    seg = _newline(ids, torch.ones_like(ids, dtype=torch.bool), tables)[0]
    assert int(seg.max()) + 1 == 3
    lines = [smollm2_tokenizer.decode(ids[0][seg == j].tolist()) for j in range(3)]
    assert lines == ["First line here\n", "second line\n", "third line"]


def test_newline_hand_table():
    # Vocabulary of 5 ids, id 2 is a boundary. Row 0: 1 2 | 3 2 | (pad); row 1: 2 | 1 (pads).
    ids = torch.tensor([[1, 2, 3, 2, 4], [2, 1, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    seg = _newline(ids, mask, _tables({2}, 5))
    assert seg.tolist() == [[0, 0, 1, 1, -1], [0, 1, -1, -1, -1]]
    assert seg.dtype == torch.int64


def test_masked_positions_neither_split_nor_validate():
    # A masked boundary id (2) in the middle does not split; masked pad id -100 is never looked up.
    ids = torch.tensor([[1, 2, 1, 2, -100]])
    mask = torch.tensor([[1, 0, 1, 1, 0]], dtype=torch.bool)
    assert _newline(ids, mask, _tables({2}, 3)).tolist() == [[0, -1, 0, 0, -1]]


def test_all_masked_row_is_all_minus_one():
    ids = torch.tensor([[0, 1, 0], [1, 1, 0]])
    mask = torch.tensor([[0, 0, 0], [1, 1, 1]], dtype=torch.bool)
    assert _newline(ids, mask, _tables({1}, 2)).tolist() == [[-1, -1, -1], [0, 1, 2]]


def test_out_of_vocab_id_raises():
    ids = torch.tensor([[0, 2]])
    with pytest.raises(ValueError, match=r"ids in \[0, 2\] but the boundary table covers \[0, 2\)"):
        _newline(ids, torch.ones_like(ids, dtype=torch.bool), _tables({1}, 2))


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match=r"\(1, 3\).*\(1, 2\)"):
        _newline(torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool), _tables({0}, 1))


def test_mask_segment_ids():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    assert mask_segment_ids("token", mask).tolist() == [[0, 1, 2, -1], [0, -1, -1, -1]]
    assert mask_segment_ids("response", mask).tolist() == [[0, 0, 0, -1], [0, -1, -1, -1]]
    # segment_ids gives the same units (its token ids are not read).
    ids = torch.zeros(2, 4, dtype=torch.long)
    assert torch.equal(segment_ids("token", ids, mask), mask_segment_ids("token", mask))


def test_mask_segment_ids_errors():
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="not 'newline'; use segment_ids"):
        mask_segment_ids("newline", mask)
    with pytest.raises(ValueError, match=r"\[B, T\] bool tensor, got \(2,\) torch.bool"):
        mask_segment_ids("token", torch.ones(2, dtype=torch.bool))
