"""``nemo-sspo data prepare --format parquet``: verl's RL dataset files from the checked JSONL.

No network: two datasets' published specs are replaced by hand-written JSONL files (their sha256
computed here), given as a folder of prepared files (``--source``). Expected values are written out
by hand from those rows. verl's own ``RLHFDataset`` reading the files: tests/integration/test_verl_dataset.py.
"""

import hashlib
import json

import pyarrow.parquet as pq
import pytest

from nemo_sspo.cli import main
from nemo_sspo.data import MATH_DATASETS
from nemo_sspo.data.math_datasets import MathDatasetFile
from nemo_sspo.data.prepare import prepare_datasets

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
TRAIN = [  # the second row's gold answer is empty: the native trainer drops it, so does the parquet
    {"id": "math_l3to5_8k/0", "problem": "What is $1+1$?", "answer": "2", "source": "math_l3to5_8k", "level": 3,
     "subject": "Algebra"},
    {"id": "math_l3to5_8k/1", "problem": "Unanswered", "answer": "", "source": "math_l3to5_8k", "level": 5},
    {"id": "math_l3to5_8k/2", "problem": "Find $x$ if $2x = 6$.", "answer": " $3$ ", "source": "math_l3to5_8k",
     "level": 4, "subject": "Prealgebra"},
]
TEST = [{"id": "amc23/0", "problem": "Compute $\\frac{1}{2}$.", "answer": "$\\frac12$.", "source": "amc23"}]


@pytest.fixture
def prepared(tmp_path, monkeypatch):
    """A folder of prepared JSONL files for math_train and amc23, their specs pointed at them."""
    source = tmp_path / "src"
    source.mkdir()
    for name, rows in (("math_train", TRAIN), ("amc23", TEST)):
        data = "".join(json.dumps(row) + "\n" for row in rows).encode()
        file = MATH_DATASETS[name].file
        (source / file).write_bytes(data)
        monkeypatch.setitem(MATH_DATASETS, name, MathDatasetFile(file, len(rows), hashlib.sha256(data).hexdigest()))
    return source


def test_parquet_rows_hold_the_jsonl_records_in_verls_schema(prepared, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["data", "prepare", "--out", str(out), "--source", str(prepared), "--only", "math_train", "amc23",
                 "--format", "parquet"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["amc23.parquet", "math_train_l3to5.parquet"]  # no JSONL
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == (f"{out / 'math_train_l3to5.parquet'}: 2 rows in verl's schema, template qwen-math "
                          f"(from {prepared / 'math_train_l3to5.jsonl'}, 3 rows, sha256 ok)")
    train = pq.read_table(out / "math_train_l3to5.parquet")
    assert train.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert train.to_pylist() == [
        {"data_source": "math_l3to5_8k",
         "prompt": [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": "What is $1+1$?"}],
         "ability": "math", "reward_model": {"style": "rule", "ground_truth": "2"},
         "extra_info": {"split": "train", "index": 0, "id": "math_l3to5_8k/0"}},
        {"data_source": "math_l3to5_8k",
         "prompt": [{"role": "system", "content": INSTRUCTION},
                    {"role": "user", "content": "Find $x$ if $2x = 6$."}],
         "ability": "math", "reward_model": {"style": "rule", "ground_truth": "3"},  # " $3$ " as the trainer reads it
         "extra_info": {"split": "train", "index": 1, "id": "math_l3to5_8k/2"}},
    ]
    assert pq.read_table(out / "amc23.parquet").to_pylist() == [
        {"data_source": "amc23",
         "prompt": [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": "Compute $\\frac{1}{2}$."}],
         "ability": "math", "reward_model": {"style": "rule", "ground_truth": "\\frac12"},
         "extra_info": {"split": "test", "index": 0, "id": "amc23/0"}}]


def test_parquet_reads_a_checked_jsonl_already_in_the_folder_and_takes_the_template(prepared, tmp_path):
    out = tmp_path / "out"
    prepare_datasets(out, names=["amc23"], source=prepared, report=lambda line: None)  # JSONL first
    (prepared / "amc23.jsonl").unlink()  # the parquet can only come from out/amc23.jsonl now
    written = prepare_datasets(out, names=["amc23"], source=prepared, report=lambda line: None,
                               file_format="parquet", template="chat-cot")
    assert written == {"amc23": out / "amc23.parquet"}
    rows = pq.read_table(out / "amc23.parquet").to_pylist()
    assert rows[0]["prompt"] == [{"role": "user", "content": "Compute $\\frac{1}{2}$.\n" + INSTRUCTION}]


def test_bad_format_and_template_flags_are_refused_with_the_fix(prepared, tmp_path, capsys):
    out = str(tmp_path / "out")
    assert main(["data", "prepare", "--out", out, "--source", str(prepared), "--template", "chat-cot"]) == 2
    assert capsys.readouterr().err.strip() == (
        "nemo-sspo: --template chat-cot: JSONL files hold the bare problem (a training run renders it with its "
        "own template); drop --template, or add --format parquet")
    assert main(["data", "prepare", "--out", out, "--format", "csv"]) == 2
    assert capsys.readouterr().err.strip() == "nemo-sspo: --format csv is unknown; valid: jsonl, parquet"
    assert main(["data", "prepare", "--out", out, "--format", "parquet", "--template", "qwen"]) == 2
    assert capsys.readouterr().err.strip() == ("nemo-sspo: --template qwen is unknown; valid: qwen-math, "
                                               "chat-boxed, chat-cot")

