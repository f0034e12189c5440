r"""The paper's math data: MATH level 3-5 training set and the evaluation benchmarks, read by path.

The files are not shipped with the package (see ``docs/data.md``): four of the eight have no stated
licence. They are read from a data directory given in the config (``data.options.data_dir`` for
training, ``eval.data_dir`` for evaluation) or, when that is null, from ``$NEMO_SSPO_DATA_DIR``.
Every file is JSONL with ``id``, ``problem``, ``answer``, ``source`` and optional ``level``,
``subject``, ``solution`` fields; this module knows each dataset's file name, row count and
sha256, and warns when a file differs from the published copy.

Gold answers are kept verbatim except for one normalisation: math-mode ``$`` delimiters are
removed (OlympiadBench stores 266 answers as ``"$2^{1009}$"`` and multi-part ones as
``"-1$,$2$,$-2"``; Qwen2.5-Math's harness strips them too), escaped ``\$`` (currency) is kept.
Numeric forms such as AMC's ``"27.0"`` or AIME's ``"025"`` need no change: the math-verify
reward compares numerically.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from nemo_sspo.data.jsonl import jsonl_lines

__all__ = [
    "DATA_DIR_ENV",
    "PREPARE_COMMAND",
    "MATH_DATASETS",
    "PAPER_BENCHMARKS",
    "MathDatasetFile",
    "MathRecord",
    "load_math_dataset",
    "normalize_gold",
    "parse_math_records",
    "resolve_data_dir",
]

_MATH_DOLLAR = re.compile(r"(?<!\\)\$")  # a $ not preceded by a backslash

DATA_DIR_ENV = "NEMO_SSPO_DATA_DIR"
"""Environment variable naming the data directory when the config leaves it null."""

PREPARE_COMMAND = "nemo-sspo data prepare --out {dir}"
"""The command that writes the data folder (:mod:`nemo_sspo.data.prepare`), named by the errors."""


@dataclass(frozen=True)
class MathDatasetFile:
    """One published file: its name in the data directory, row count and sha256."""

    file: str
    rows: int
    sha256: str


MATH_DATASETS = {
    "math_train": MathDatasetFile(
        "math_train_l3to5.jsonl", 8523, "dd6881f28bf5896d8180323feaa6be1bd21d58fc69a443a5391e41850488de67"),
    "math500": MathDatasetFile(
        "math500.jsonl", 500, "234d4c882bc237bbac5434c6c161247488cd8b5918575aae748137d5afdff722"),
    "amc23": MathDatasetFile(
        "amc23.jsonl", 40, "63057b5f249282495bd22699d21e3d6c1bd41bd3ebd3bf8e4c91342f31366e6d"),
    "amc83": MathDatasetFile(
        "amc83.jsonl", 83, "d82c068b00b2c6a5357dc665ca1be393ef21531bb305361905a3bdfabf669bb6"),
    "aime24": MathDatasetFile(
        "aime24.jsonl", 30, "932a5ec9c4fb181a6fc58f92439d72a0cc565940eabdf7bf23d4da60df010376"),
    "minerva_math": MathDatasetFile(
        "minerva_math.jsonl", 272, "6d56a23f2e3b97aa7f07e94b0bd12edbffea4c9535f1f96e3bf54a2e4075fc68"),
    "olympiadbench": MathDatasetFile(
        "olympiadbench.jsonl", 675, "cfd5488eca9802319216d757d720e97d8a098ae8293efe9f667493552c258550"),
    "gsm8k": MathDatasetFile(
        "gsm8k_test.jsonl", 1319, "86cab51fc45e0ec3c964cf046fb41ce212d2acf0a877f605c0a0e4b71100eb34"),
}
"""Dataset name -> published file (sources and licences: ``docs/data.md``)."""

PAPER_BENCHMARKS = ("math500", "amc83", "aime24", "minerva_math", "olympiadbench")
"""The paper's five evaluation sets. Its "AMC" is the 83-problem set of the Dr. GRPO evaluation
suite (``amc83``); ``amc23`` (the 40 AMC 2023 problems of Qwen2.5-Math's harness) is a subset."""


@dataclass(frozen=True)
class MathRecord:
    """One problem: ``answer`` is the normalised gold answer (see :func:`normalize_gold`)."""

    id: str
    problem: str
    answer: str
    source: str
    level: int | None = None
    subject: str | None = None


def resolve_data_dir(data_dir: str | None, key: str) -> Path:
    """``data_dir``, or ``$NEMO_SSPO_DATA_DIR`` when it is None/empty, as an existing directory.

    Args:
        data_dir: the folder given, or None for ``$NEMO_SSPO_DATA_DIR``.
        key: the config key that holds ``data_dir`` (named in the error message).

    Raises:
        ValueError: neither is set, or the directory does not exist.
    """
    chosen = data_dir or os.environ.get(DATA_DIR_ENV)
    if not chosen:
        raise ValueError(
            f"{key} is not set and ${DATA_DIR_ENV} is empty: prepare the math data once with "
            f"`{PREPARE_COMMAND.format(dir='/path/to/data')}`, then set {key}=/path/to/data or export "
            f"{DATA_DIR_ENV}=/path/to/data (docs/data.md)"
        )
    path = Path(chosen).expanduser()
    if not path.is_dir():
        raise ValueError(f"{key}={str(chosen)!r} is not a directory; create it with "
                         f"`{PREPARE_COMMAND.format(dir=chosen)}`")
    return path


def normalize_gold(answer: str) -> str:
    r"""The gold answer without math-mode ``$`` delimiters (``\$`` is kept) and surrounding blanks.

    A sentence period after a closing delimiter goes too (``"$(-\infty, 0)$."`` -> ``"(-\infty, 0)"``).
    """
    text = answer.strip()
    if text.endswith("$."):
        text = text[:-1]
    return _MATH_DOLLAR.sub("", text).strip()


def load_math_dataset(name: str, data_dir: str | None = None, *, key: str = "data_dir",
                      drop_empty_answers: bool = True) -> list[MathRecord]:
    """All records of dataset ``name`` in file order.

    Args:
        name: a key of :data:`MATH_DATASETS`.
        data_dir: folder holding the file (None: ``$NEMO_SSPO_DATA_DIR``).
        key: the config key of ``data_dir``, for error messages.
        drop_empty_answers: skip records whose gold answer is empty (2 rows of ``math_train``,
            whose boxed answer extraction failed upstream; such a problem could never be
            rewarded).

    Warns:
        UserWarning: the file's sha256 differs from the published one (a different copy).

    Raises:
        ValueError: unknown ``name`` (lists the valid ones), missing data directory or file, or a
            line that is not a JSON object with ``id``, ``problem`` and ``answer`` (names file and line).
    """
    if name not in MATH_DATASETS:
        raise ValueError(f"math dataset {name!r} is unknown; valid: {', '.join(MATH_DATASETS)}")
    spec = MATH_DATASETS[name]
    path = resolve_data_dir(data_dir, key) / spec.file
    if not path.is_file():
        raise ValueError(f"{key}: {path} does not exist; write it with "
                         f"`{PREPARE_COMMAND.format(dir=path.parent)} --only {name}` (docs/data.md)")
    raw = path.read_bytes()
    if hashlib.sha256(raw).hexdigest() != spec.sha256:
        warnings.warn(f"{path} differs from the published {spec.file} (sha256 mismatch; expected "
                      f"{spec.rows} rows): results are not comparable with the paper's", stacklevel=2)
    return parse_math_records(raw, path, drop_empty_answers=drop_empty_answers)


def parse_math_records(raw: bytes, path: Path | str, *, drop_empty_answers: bool = True) -> list[MathRecord]:
    """The records of one dataset file's bytes ``raw`` (UTF-8 JSONL) in file order, gold answers
    normalised (:func:`normalize_gold`); ``path`` names the file in error messages.

    Args:
        raw: the file's content.
        path: where it came from.
        drop_empty_answers: skip records whose gold answer is empty (see :func:`load_math_dataset`).

    Raises:
        ValueError: a line that is not a JSON object with ``id``, ``problem`` and ``answer`` (names
            file and line).
    """
    records = [_parse_line(line, path, number) for number, line in jsonl_lines(raw.decode("utf-8"))]
    return [r for r in records if r.answer or not drop_empty_answers]


def _parse_line(line: str, path: Path | str, number: int) -> MathRecord:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{number} is not valid JSON ({err.msg})") from err
    if not isinstance(record, dict) or not {"id", "problem", "answer"} <= record.keys():
        raise ValueError(f"{path}:{number} must be a JSON object with 'id', 'problem' and 'answer'")
    level = record.get("level")
    return MathRecord(id=str(record["id"]), problem=str(record["problem"]),
                      answer=normalize_gold(str(record["answer"])), source=str(record.get("source", "")),
                      level=int(level) if level is not None else None, subject=record.get("subject"))
