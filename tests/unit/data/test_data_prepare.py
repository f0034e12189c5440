"""``nemo-sspo data prepare``: public source files -> the data folder, every file checked.

No network here: the converters run on hand-written rows in each source's own format (values by
hand below), the checks on a mirror folder written in the test, and the whole command on the
published copies (``$NEMO_SSPO_DATA_DIR`` or the shared data folder beside the repository, as
``test_math_datasets``) given as ``--source``.
"""

import hashlib
import io
import json
import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nemo_sspo.cli import main
from nemo_sspo.data import MATH_DATASETS, load_math_dataset
from nemo_sspo.data.prepare import SOURCES, _git_blob, prepare_datasets
from tests.unit.data.test_math_datasets import PUBLISHED, needs_published


def _jsonl(rows):
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def test_git_blob_hash_equals_git_hash_object(tmp_path):
    path = tmp_path / "f.jsonl"
    path.write_bytes('{"problem": "1 + 1 = ?", "answer": "2"}\n'.encode())
    expected = subprocess.run(["git", "hash-object", str(path)], capture_output=True, text=True, check=True).stdout
    assert _git_blob(path.read_bytes()) == expected.strip()


def test_qwen_harness_rows_convert_to_our_schema():
    gsm8k = _jsonl([{"question": "Tom has 3 apples.", "answer": "3 + 0 = <<3+0=3>>3\n#### 1,450", "idx": 7}])
    assert SOURCES["gsm8k"].convert(gsm8k) == [{"id": "gsm8k/test/7", "problem": "Tom has 3 apples.",
                                               "answer": "1,450", "source": "gsm8k",
                                               "solution": "3 + 0 = <<3+0=3>>3"}]
    # Minerva has no answer field: the last \boxed{} (or \fbox{}) of the solution, braces balanced.
    minerva = _jsonl([{"problem": "P", "solution": "so \\boxed{1} then \\boxed{\\frac{1}{2}} cm", "type": "8.01",
                       "idx": 3}])
    assert SOURCES["minerva_math"].convert(minerva)[0]["answer"] == "\\frac{1}{2}"
    olympiad = _jsonl([{"id": 12, "subfield": "Algebra", "context": None, "question": "Q", "solution": ["S1", "S2"],
                        "final_answer": ["$2^{1009}$"], "is_multiple_answer": False, "unit": None}])
    assert SOURCES["olympiadbench"].convert(olympiad) == [{"id": "olympiadbench/12", "problem": "Q",
                                                          "answer": "$2^{1009}$", "source": "olympiadbench",
                                                          "subject": "Algebra", "solution": "S1"}]
    amc = _jsonl([{"id": 0, "problem": "P", "answer": 27.0, "url": "u", "question": "P"}])
    assert SOURCES["amc23"].convert(amc) == [{"id": "amc23/0", "problem": "P", "answer": "27.0", "source": "amc23"}]
    aime = _jsonl([{"id": 60, "problem": "P", "solution": "S", "answer": "025", "url": "u"}])
    assert SOURCES["aime24"].convert(aime)[0] == {"id": "aime24/60", "problem": "P", "answer": "025",
                                                  "source": "aime24", "solution": "S"}


def test_parquet_and_arrow_sources_convert():
    table = pa.table({"question": ["Q0", "Q1"], "answer": ["118", "7"], "level": [5, 3],
                      "subject": ["Algebra", "Geometry"], "extra_info": [{"level": 1}, {"level": 1}]})
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    rows = SOURCES["math_train"].convert(buffer.getvalue())
    # the top-level level is the MATH level (extra_info.level is always 1 upstream); ids by row index
    assert rows[1] == {"id": "math_l3to5_8k/1", "problem": "Q1", "answer": "7", "source": "math_l3to5_8k",
                       "level": 3, "subject": "Geometry"}
    stream = io.BytesIO()
    amc = pa.table({"problem": ["P"], "answer": [142.0], "difficulty": [2.0]})
    with pa.ipc.new_stream(stream, amc.schema) as writer:  # datasets.save_to_disk's Arrow stream format
        writer.write_table(amc)
    assert SOURCES["amc83"].convert(stream.getvalue()) == [{"id": "amc83/0", "problem": "P", "answer": "142.0",
                                                            "source": "amc83"}]


def test_a_source_with_another_blob_is_refused_and_nothing_written(tmp_path):
    source = SOURCES["amc23"]
    mirror = tmp_path / "mirror" / source.repo / source.commit / source.path
    mirror.parent.mkdir(parents=True)
    mirror.write_bytes(_jsonl([{"id": 0, "problem": "P", "answer": 1.0}]))
    with pytest.raises(ValueError, match=f"is not the published {source.blob}"):
        prepare_datasets(tmp_path / "out", names=["amc23"], source=tmp_path / "mirror", report=lambda line: None)
    assert not (tmp_path / "out" / "amc23.jsonl").exists()
    with pytest.raises(FileNotFoundError, match="aime24/test.jsonl is missing"):
        prepare_datasets(tmp_path / "out", names=["aime24"], source=tmp_path / "mirror", report=lambda line: None)


def test_a_prepared_copy_with_other_rows_is_refused(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "amc23.jsonl").write_bytes(_jsonl([{"id": "amc23/0", "problem": "P", "answer": "1"}]))
    with pytest.raises(ValueError, match=r"amc23 from .*: 1 rows, sha256 .*; the published amc23.jsonl has 40 rows"):
        prepare_datasets(tmp_path / "out", names=["amc23"], source=tmp_path / "src", report=lambda line: None)
    assert not (tmp_path / "out" / "amc23.jsonl").exists()
    with pytest.raises(ValueError, match="unknown datasets"):
        prepare_datasets(tmp_path / "out", names=["amc24"])


def test_a_missing_data_file_names_the_prepare_command(tmp_path):
    with pytest.raises(ValueError, match=f"nemo-sspo data prepare --out {tmp_path} --only math500"):
        load_math_dataset("math500", str(tmp_path), key="eval.data_dir")


@needs_published
def test_prepare_command_writes_every_dataset_checked(tmp_path, capsys):
    out = tmp_path / "data"
    assert main(["data", "prepare", "--out", str(out), "--source", str(PUBLISHED)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == (f"datasets written to {out}: {', '.join(MATH_DATASETS)}; use them with: "
                           f"export NEMO_SSPO_DATA_DIR={out}")
    for name, spec in MATH_DATASETS.items():
        assert hashlib.sha256((out / spec.file).read_bytes()).hexdigest() == spec.sha256, name
    # a second run keeps the checked files
    assert main(["data", "prepare", "--out", str(out), "--only", "math500"]) == 0
    assert capsys.readouterr().out.startswith(f"{out / 'math500.jsonl'}: already prepared (500 rows, sha256 ok)")
