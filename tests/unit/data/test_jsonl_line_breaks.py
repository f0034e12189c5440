"""JSONL records holding U+2028, U+2029 and U+0085 inside strings (legal JSON, common in scraped
math text) read as one record in every reader and are written line-safe (docs/pitfalls.md#jsonl-line-breaks).

The files are written here by hand (raw characters, not escapes), so each reader sees what a
scraped file holds; the expected records are the Python dicts they were written from."""

import hashlib
import json
import warnings

from nemo_sspo.data import build_prompt_source, load_math_dataset
from nemo_sspo.data.jsonl import jsonl_line, jsonl_lines
from nemo_sspo.data.math_datasets import MathDatasetFile
from nemo_sspo.data.prepare import _check, _jsonl, _serialise
from nemo_sspo.evaluation.benchmark import _write_jsonl

BREAKS = ("\u2028", "\u2029", "\x85")
ROWS = [{"id": "a/0", "problem": "Let x = 1.\u2028Find x\u2029 + 1.", "answer": "2"},
        {"id": "a/1", "problem": "Next\x85line: 3 - 1?", "answer": "2"},
        {"id": "a/2", "problem": "plain", "answer": "5"}]


def _raw_file(path, rows):
    """``json.dumps(ensure_ascii=False)``: the break characters stay raw inside the strings."""
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    assert all(char in text for char in BREAKS)
    assert len(text.splitlines()) == 6  # what a splitlines reader sees: 3 records, 3 more breaks
    path.write_bytes(text.encode("utf-8"))
    return path


def test_split_only_on_newline():
    # Two records, a blank line between them, a CRLF ending: lines 1 and 3 (editor numbering).
    text = '{"a": "x\u2028y"}\r\n\n{"b": "\x85"}\n'
    assert [(n, json.loads(line)) for n, line in jsonl_lines(text)] == [(1, {"a": "x\u2028y"}), (3, {"b": "\x85"})]


def test_jsonl_prompt_source_reads_each_record_once(tmp_path):
    path = _raw_file(tmp_path / "p.jsonl", ROWS)
    problems = build_prompt_source("jsonl", seed=0, path=str(path)).sample(3)
    assert sorted((p.question, p.answer) for p in problems) == sorted((r["problem"], r["answer"]) for r in ROWS)


def test_math_loader_reads_each_record_once(tmp_path):
    _raw_file(tmp_path / "aime24.jsonl", ROWS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # our file is not the published one (sha256 warning)
        records = load_math_dataset("aime24", str(tmp_path))
    assert [(r.id, r.problem) for r in records] == [(r["id"], r["problem"]) for r in ROWS]


def test_prepare_counts_rows_and_round_trips_line_safe():
    data = _serialise(ROWS)
    # The writer escapes the three characters: the file is 3 lines for any line splitter, and
    # decodes to the same strings.
    text = data.decode("utf-8")
    assert not any(char in text for char in BREAKS)
    assert len(text.splitlines()) == 3 and [json.loads(line) for line in text.splitlines()] == ROWS
    assert _jsonl(data) == ROWS
    # The row count of the check: 3 rows and this file's sha256 pass (a 6-row count would raise).
    _check("aime24", MathDatasetFile("aime24.jsonl", 3, hashlib.sha256(data).hexdigest()), data, "here")
    # A raw (unescaped) source file converts to the same rows.
    raw = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in ROWS).encode("utf-8")
    assert _jsonl(raw) == ROWS


def test_writers_escape_only_the_three_breaks(tmp_path):
    plain = {"q": "é ∑ 1/2", "n": 1}
    assert jsonl_line(plain) == json.dumps(plain, ensure_ascii=False) + "\n"  # bytes unchanged without them
    assert jsonl_line({"q": "a\u2028b\x85"}) == '{"q": "a\\u2028b\\u0085"}\n'
    _write_jsonl(tmp_path / "samples.jsonl", ROWS)  # eval samples: a model's response may hold them too
    lines = (tmp_path / "samples.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == ROWS
