"""``nemo-sspo data prepare``: the paper's training and evaluation sets from their public sources.

Each dataset of :data:`nemo_sspo.data.MATH_DATASETS` comes from one file at a fixed commit of a
public GitHub repository (:data:`SOURCES`): the file is downloaded (``raw.githubusercontent.com``),
checked against its git blob hash (the checksum GitHub publishes for every file of a commit),
converted to the JSONL schema of ``docs/data.md``, and the result checked against the dataset's
row count and sha256 before it is written into the data folder (written to a temporary name, then
renamed, so a folder never holds half a file). A file already there with the right sha256 is kept.

``source`` (``--source`` or ``$NEMO_SSPO_DATA_SOURCE``) replaces the download: a folder laid out as
``<owner>/<repo>/<commit>/<path>`` (a mirror of the raw files), or a folder of already prepared
JSONL files (copied after the same checks). Tests and machines without network use it.

``file_format="parquet"`` (``--format parquet``) writes ``<name>.parquet`` instead (the JSONL file
name with ``.parquet``) in verl's RL dataset schema: the columns verl's ``RLHFDataset`` and reward
manager read, as in ``examples/data_preprocess/math_dataset.py`` of verl's repository.
``data_source`` is our ``source`` field, ``prompt`` the chat messages of ``template``'s prompt
(:func:`nemo_sspo.data.templates.prompt_messages`), ``ability`` ``"math"``, ``reward_model``
``{"style": "rule", "ground_truth": <gold answer>}`` and ``extra_info`` ``{"split", "index", "id"}``.
The rows are the records the native trainer reads (``load_math_dataset``: gold answers normalised,
empty answers dropped), from the same checked JSONL.

The conversions (which fields are kept and how answers are read) are ours; the choice of source
files and fields follows the files' own documentation in ``docs/data.md``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from nemo_sspo.data.jsonl import jsonl_line, jsonl_lines
from nemo_sspo.data.math_datasets import MATH_DATASETS, MathDatasetFile, MathRecord, parse_math_records
from nemo_sspo.data.templates import TEMPLATES, prompt_messages

__all__ = ["FORMATS", "SOURCE_ENV", "SOURCES", "RawSource", "prepare_datasets"]

FORMATS = ("jsonl", "parquet")
"""Valid ``file_format`` values of :func:`prepare_datasets` (``--format``)."""

SOURCE_ENV = "NEMO_SSPO_DATA_SOURCE"
"""Environment variable naming a local source folder (as ``--source``)."""

_RAW_URL = "https://raw.githubusercontent.com/{repo}/{commit}/{path}"
_QWEN = ("QwenLM/Qwen2.5-Math", "a45202bd16f1ec06f433442dc1152d0074773465")


@dataclass(frozen=True)
class RawSource:
    r"""One published source file: ``repo`` (owner/name) at ``commit``, ``path`` in it, its git blob
    hash (sha1 of ``"blob <size>\0" + content``) and the converter to our rows.
    """

    repo: str
    commit: str
    path: str
    blob: str
    convert: Callable[[bytes], list[dict]]

    @property
    def url(self) -> str:
        """Where the file is downloaded from."""
        return _RAW_URL.format(repo=self.repo, commit=self.commit, path=self.path)


def _jsonl(raw: bytes) -> list[dict]:
    return [json.loads(line) for _, line in jsonl_lines(raw.decode("utf-8"))]


def _last_boxed(text: str) -> str:
    r"""The content of the last ``\boxed{...}`` or ``\fbox{...}`` of ``text`` (balanced braces)."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        raise ValueError("solution has no \\boxed{} answer")
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[begin:i - 1]


def _math500(raw: bytes) -> list[dict]:
    return [{"id": r["unique_id"], "problem": r["problem"], "answer": r["answer"], "source": "math500",
             "level": int(r["level"]), "subject": r["subject"], "solution": r["solution"]} for r in _jsonl(raw)]


def _table_rows(raw: bytes, kind: str) -> list[dict]:
    """Rows of a parquet file or of an Arrow stream (``datasets.save_to_disk``), with pyarrow."""
    pa, pq = _pyarrow("reading the parquet / Arrow sources (math_train, amc83)",
                      "or prepare the others with --only")
    if kind == "parquet":
        return pq.read_table(io.BytesIO(raw)).to_pylist()
    return pa.ipc.open_stream(io.BytesIO(raw)).read_all().to_pylist()


def _pyarrow(purpose: str, alternative: str):
    """``pyarrow`` and ``pyarrow.parquet``, imported here so the JSONL path needs neither."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError(f"{purpose} needs pyarrow: pip install 'nemo_sspo[data]' (or pyarrow), "
                          f"{alternative}") from err
    return pa, pq


def _math_train(raw: bytes) -> list[dict]:
    return [{"id": f"math_l3to5_8k/{i}", "problem": r["question"], "answer": r["answer"], "source": "math_l3to5_8k",
             "level": int(r["level"]), "subject": r["subject"]} for i, r in enumerate(_table_rows(raw, "parquet"))]


def _amc83(raw: bytes) -> list[dict]:
    return [{"id": f"amc83/{i}", "problem": r["problem"], "answer": str(r["answer"]), "source": "amc83"}
            for i, r in enumerate(_table_rows(raw, "arrow"))]


def _aime24(raw: bytes) -> list[dict]:
    return [{"id": f"aime24/{r['id']}", "problem": r["problem"], "answer": str(r["answer"]), "source": "aime24",
             "solution": r["solution"]} for r in _jsonl(raw)]


def _amc23(raw: bytes) -> list[dict]:
    return [{"id": f"amc23/{r['id']}", "problem": r["problem"], "answer": str(r["answer"]), "source": "amc23"}
            for r in _jsonl(raw)]


def _minerva(raw: bytes) -> list[dict]:
    return [{"id": f"minerva_math/{r['idx']}", "problem": r["problem"], "answer": _last_boxed(r["solution"]),
             "source": "minerva_math", "subject": r["type"], "solution": r["solution"]} for r in _jsonl(raw)]


def _olympiadbench(raw: bytes) -> list[dict]:
    return [{"id": f"olympiadbench/{r['id']}", "problem": r["question"], "answer": r["final_answer"][0],
             "source": "olympiadbench", "subject": r["subfield"], "solution": r["solution"][0]} for r in _jsonl(raw)]


def _gsm8k(raw: bytes) -> list[dict]:
    rows = []
    for r in _jsonl(raw):
        solution, answer = r["answer"].split("####")
        rows.append({"id": f"gsm8k/test/{r['idx']}", "problem": r["question"], "answer": answer.strip(),
                     "source": "gsm8k", "solution": solution.strip()})
    return rows


SOURCES = {
    "math_train": RawSource("hkust-nlp/simpleRL-reason", "d3826b22da38419195d8b3ef8bb4b6e8ce4a0d73", "train.parquet",
                            "ef737f281a9e00eb252108187f0c9d0799b45b59", _math_train),
    "math500": RawSource("hkust-nlp/simpleRL-reason", "cf1c7858bfc145a27aa733e75d930d34f0d318a6",
                         "examples/simplelr_math_eval/data/math500/test.jsonl",
                         "2376b9a194b46c0790e197c91b7249e5f88ac09b", _math500),
    "amc23": RawSource(*_QWEN, "evaluation/data/amc23/test.jsonl", "6894ad7c49a0b3a64210af32954f4d049d934ea0", _amc23),
    "amc83": RawSource("sail-sg/understand-r1-zero", "dfca49dd460ee7cc8e4a5a162c876a7fd6993b87",
                       "datasets/evaluation_suite/amc/data-00000-of-00001.arrow",
                       "16f8737f361bb60f6741ac228e9de0ed7eaab16f", _amc83),
    "aime24": RawSource(*_QWEN, "evaluation/data/aime24/test.jsonl", "bb72e176e8d30c09cd67037e17cfc41e6ff48f70",
                        _aime24),
    "minerva_math": RawSource(*_QWEN, "evaluation/data/minerva_math/test.jsonl",
                              "123c5cd351cac2b8ead5413bc084629d7ff651de", _minerva),
    "olympiadbench": RawSource(*_QWEN, "evaluation/data/olympiadbench/test.jsonl",
                               "ec36280b1de8f5bbee92da696c2ae84f5f6e6beb", _olympiadbench),
    "gsm8k": RawSource(*_QWEN, "evaluation/data/gsm8k/test.jsonl", "3e6e62b831b5fcbf0585d0dce75ccc5e4ccb691c", _gsm8k),
}
"""Dataset name -> its public source file (the commits and paths of ``docs/data.md``)."""


def _git_blob(raw: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(raw) + raw).hexdigest()


def _serialise(rows: list[dict]) -> bytes:
    return "".join(jsonl_line(row) for row in rows).encode("utf-8")


def _fetch(source: RawSource, local: Path | None) -> tuple[bytes, str]:
    """The raw file and where it was read: ``local/<repo>/<commit>/<path>`` when given, else its URL."""
    if local is not None:
        path = local / source.repo / source.commit / source.path
        if not path.is_file():
            raise FileNotFoundError(f"--source {local}: {path} is missing (a mirror holds "
                                    "<owner>/<repo>/<commit>/<path> for every source file)")
        return path.read_bytes(), str(path)
    try:
        with urllib.request.urlopen(source.url, timeout=120) as response:  # noqa: S310 - fixed https URL
            return response.read(), source.url
    except OSError as err:
        raise OSError(f"downloading {source.url} failed ({err}); on a machine without network, "
                      f"pass --source with a folder holding the files (or ${SOURCE_ENV})") from err


def _prepared(name: str, spec: MathDatasetFile, local: Path | None) -> tuple[bytes, str]:
    """The dataset's JSONL bytes and where they came from, checked against the published blob."""
    if local is not None and (local / spec.file).is_file():  # a folder of prepared files
        return (local / spec.file).read_bytes(), str(local / spec.file)
    source = SOURCES[name]
    raw, origin = _fetch(source, local)
    if _git_blob(raw) != source.blob:
        raise ValueError(f"{origin}: git blob {_git_blob(raw)} is not the published {source.blob} of "
                         f"{source.url}; the file changed or the download is damaged")
    return _serialise(source.convert(raw)), origin


def _check(name: str, spec: MathDatasetFile, data: bytes, origin: str) -> None:
    rows = sum(1 for _ in jsonl_lines(data.decode("utf-8")))
    digest = hashlib.sha256(data).hexdigest()
    if rows != spec.rows or digest != spec.sha256:
        raise ValueError(f"{name} from {origin}: {rows} rows, sha256 {digest}; the published {spec.file} has "
                         f"{spec.rows} rows, sha256 {spec.sha256}")


def _verl_rows(records: list[MathRecord], *, template: str, split: str) -> list[dict]:
    """``records`` as rows of verl's RL dataset (module docstring), indexed in file order."""
    return [{"data_source": r.source, "prompt": prompt_messages(r.problem, template), "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": r.answer},
             "extra_info": {"split": split, "index": index, "id": r.id}} for index, r in enumerate(records)]


def _write_parquet(name: str, data: bytes, origin: str, target: Path, template: str) -> int:
    """Writes the checked JSONL ``data`` of dataset ``name`` to ``target`` as verl rows; their count."""
    pa, pq = _pyarrow("--format parquet", "or keep the default --format jsonl")
    split = "train" if name == "math_train" else "test"
    rows = _verl_rows(parse_math_records(data, origin), template=template, split=split)
    tmp = target.with_name(f".{target.name}.tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    tmp.replace(target)
    return len(rows)


def prepare_datasets(out: str | Path, *, names: list[str] | None = None, source: str | Path | None = None,
                     report: Callable[[str], None] = print, file_format: str = "jsonl",
                     template: str | None = None) -> dict[str, Path]:
    """Writes the datasets into ``out``, each checked against its published row count and sha256
    (:data:`nemo_sspo.data.MATH_DATASETS`): JSONL files, or verl's parquet files.

    Args:
        out: the data folder (created if needed); point ``$NEMO_SSPO_DATA_DIR`` or the config's
            ``data.options.data_dir`` / ``eval.data_dir`` at it (JSONL), or verl's
            ``data.train_files`` / ``data.val_files`` at its parquet files.
        names: datasets to prepare (default: all of :data:`MATH_DATASETS`).
        source: a local folder used instead of downloading (module docstring); None reads
            ``$NEMO_SSPO_DATA_SOURCE``, and downloads when that is unset too.
        report: called with one line per file.
        file_format: ``"jsonl"`` (the native trainer's files) or ``"parquet"`` (verl's RL dataset
            schema, module docstring; needs pyarrow). The parquet rows come from the checked JSONL:
            a correct JSONL file already in ``out`` is read instead of the source; no JSONL is written.
        template: the prompt template of the parquet ``prompt`` column (one of
            :data:`~nemo_sspo.data.templates.TEMPLATES`; None: ``"qwen-math"``, the paper recipes'
            ``data.template``). Parquet only: a JSONL file holds the bare problem, rendered by the
            training config's ``data.template``.

    Returns:
        Dataset name -> the file written (or found already correct) in ``out``.

    Raises:
        ValueError: an unknown name, format or template, a template with ``file_format="jsonl"``,
            or a source or result that fails its checksum or row count (nothing is written for that
            file; files already written stay).
        FileNotFoundError, OSError: a source file missing from ``source``, or a failed download.
        ImportError: ``file_format="parquet"`` without pyarrow.
    """
    unknown = sorted(set(names or ()) - set(MATH_DATASETS))
    if unknown:
        raise ValueError(f"unknown datasets {unknown}; valid: {', '.join(MATH_DATASETS)}")
    if file_format not in FORMATS:
        raise ValueError(f"--format {file_format} is unknown; valid: {', '.join(FORMATS)}")
    if template is not None and file_format == "jsonl":
        raise ValueError(f"--template {template}: JSONL files hold the bare problem (a training run renders it "
                         "with its own template); drop --template, or add --format parquet")
    template = template or "qwen-math"
    if template not in TEMPLATES:
        raise ValueError(f"--template {template} is unknown; valid: {', '.join(TEMPLATES)}")
    source = source or os.environ.get(SOURCE_ENV) or None
    local = Path(source).expanduser() if source is not None else None
    if local is not None and not local.is_dir():
        raise FileNotFoundError(f"--source {local} is not a folder")
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for name in names or list(MATH_DATASETS):
        spec = MATH_DATASETS[name]
        jsonl = out / spec.file
        present = jsonl.is_file() and hashlib.sha256(jsonl.read_bytes()).hexdigest() == spec.sha256
        if present and file_format == "jsonl":
            report(f"{jsonl}: already prepared ({spec.rows} rows, sha256 ok)")
            written[name] = jsonl
            continue
        if present:
            data, origin = jsonl.read_bytes(), str(jsonl)
        else:
            data, origin = _prepared(name, spec, local)
            _check(name, spec, data, origin)
        if file_format == "jsonl":
            tmp = jsonl.with_name(f".{jsonl.name}.tmp")
            tmp.write_bytes(data)
            tmp.replace(jsonl)
            report(f"{jsonl}: {spec.rows} rows, sha256 ok (from {origin})")
            written[name] = jsonl
        else:
            target = jsonl.with_suffix(".parquet")
            rows = _write_parquet(name, data, origin, target, template)
            report(f"{target}: {rows} rows in verl's schema, template {template} (from {origin}, "
                   f"{spec.rows} rows, sha256 ok)")
            written[name] = target
    return written
