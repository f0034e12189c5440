"""The paper's math datasets: loading by path, gold normalisation, the `math` prompt source.

The published files are read from ``$NEMO_SSPO_DATA_DIR`` or the ``shared/data`` folder beside the
repository (where CI has it); those checks skip when neither exists. Everything else uses files
written here.
"""

import json
import os
from pathlib import Path

import pytest

from nemo_sspo.cli import load_config
from nemo_sspo.data import MATH_DATASETS, PAPER_BENCHMARKS, build_prompt_source, load_math_dataset
from nemo_sspo.data.math_datasets import normalize_gold
from nemo_sspo.data.tasks import MathOptions
from nemo_sspo.trainer.config import at_key

_SHARED = Path(__file__).resolve().parents[4] / "shared" / "data"
PUBLISHED = Path(os.environ.get("NEMO_SSPO_DATA_DIR") or _SHARED)
needs_published = pytest.mark.skipif(not (PUBLISHED / "math500.jsonl").is_file(),
                                     reason=f"published data not found in {PUBLISHED}")


@needs_published
def test_published_files_load_with_their_row_counts():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a sha256 mismatch would raise here
        sizes = {name: len(load_math_dataset(name, str(PUBLISHED))) for name in MATH_DATASETS}
    # math_train: 8,523 rows minus the 2 with an empty gold answer (README: ids 5054 and 5158).
    assert sizes == {"math_train": 8521, "math500": 500, "amc23": 40, "amc83": 83, "aime24": 30,
                     "minerva_math": 272, "olympiadbench": 675, "gsm8k": 1319}
    olympiad = load_math_dataset("olympiadbench", str(PUBLISHED))
    assert not any("$" in r.answer for r in olympiad)  # 266 "$...$" golds unwrapped
    math500 = load_math_dataset("math500", str(PUBLISHED))
    assert (math500[0].id, math500[0].level) == ("test/precalculus/807.json", 2)
    assert set(PAPER_BENCHMARKS) <= set(MATH_DATASETS)


def test_normalize_gold_strips_dollar_delimiters_only():
    assert normalize_gold(" $2^{1009}$ ") == "2^{1009}"
    assert normalize_gold("$$x$$") == "x"
    assert normalize_gold("-1$,$2$,$-2") == "-1,2,-2"  # OlympiadBench multi-part answers
    assert normalize_gold("$(-\\infty, 0) \\cup\\{1\\}$.") == "(-\\infty, 0) \\cup\\{1\\}"
    assert normalize_gold("\\$18.90") == "\\$18.90"  # an escaped dollar sign is content
    assert normalize_gold("27.0") == "27.0"


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_math_prompt_source_is_seeded_and_drops_empty_answers(tmp_path):
    rows = [{"id": f"m/{i}", "problem": f"P{i}", "answer": str(i) if i != 2 else "", "level": 3}
            for i in range(5)]
    _write(tmp_path / "math_train_l3to5.jsonl", rows)
    with pytest.warns(UserWarning, match="sha256"):
        first = build_prompt_source("math", seed=1, dataset="math_train", data_dir=str(tmp_path)).sample(8)
    with pytest.warns(UserWarning):
        again = build_prompt_source("math", seed=1, dataset="math_train", data_dir=str(tmp_path)).sample(8)
    assert first == again
    # One epoch = the 4 problems with an answer, each once; then the next shuffled epoch.
    assert sorted(p.question for p in first[:4]) == ["P0", "P1", "P3", "P4"]
    assert all(p.answer == p.question[1:] for p in first)


def test_missing_data_dir_names_the_key_and_env(tmp_path, monkeypatch):
    monkeypatch.delenv("NEMO_SSPO_DATA_DIR", raising=False)
    with pytest.raises(ValueError, match=r"^data_dir is not set and \$NEMO_SSPO_DATA_DIR"):
        build_prompt_source("math", seed=0, dataset="math_train")
    # The trainer builds its source through at_key, which puts the config key path in front.
    with pytest.raises(ValueError, match=r"^data.options.data_dir is not set"):
        at_key("data.options.", lambda: build_prompt_source("math", seed=0, dataset="math_train"))
    with pytest.raises(ValueError, match="math_train_l3to5.jsonl"):
        build_prompt_source("math", seed=0, dataset="math_train", data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="valid: math_train, math500"):
        build_prompt_source("math", seed=0, dataset="math600", data_dir=str(tmp_path))
    monkeypatch.setenv("NEMO_SSPO_DATA_DIR", str(tmp_path))  # the environment fallback is read
    _write(tmp_path / "math500.jsonl", [{"id": "a", "problem": "Q", "answer": "1"}])
    with pytest.warns(UserWarning):
        assert build_prompt_source("math", seed=0, dataset="math500").sample(1)[0].answer == "1"


def test_bad_line_names_file_and_line(tmp_path):
    (tmp_path / "aime24.jsonl").write_text('{"id": "a", "problem": "Q", "answer": "1"}\n{"id": "b"}\n')
    with pytest.raises(ValueError, match=r"aime24.jsonl:2 must be a JSON object with 'id', 'problem'"), \
            pytest.warns(UserWarning):
        load_math_dataset("aime24", str(tmp_path))


def test_data_groups_select_the_math_source():
    cfg = load_config(overrides=["data=math_train", "data.options.data_dir=/data/x"])
    assert (cfg.data.source, cfg.data.template, cfg.data.options) == (
        "math", "qwen-math", MathOptions(dataset="math_train", data_dir="/data/x"))
    assert load_config(overrides=["data=math500"]).data.options.dataset == "math500"
