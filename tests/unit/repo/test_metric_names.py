"""The metric-name table of docs/trackers.md ("Metric names next to verl and NeMo-RL"): every verl
name occurs in the installed verl's source. Our names are checked against the metrics.jsonl record
of a real run in tests/integration/test_train_loop.py (the table is read by :func:`metric_table`)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SECTION = "## Metric names next to verl and NeMo-RL"


def metric_table() -> list[tuple[str, str, str]]:
    """(ours, verl, NeMo-RL) for each row of the table in docs/trackers.md; "—" where none."""
    section = (ROOT / "docs" / "trackers.md").read_text().split(SECTION, 1)[1]
    rows = []
    for line in section.splitlines():
        if line.startswith("| `"):
            cells = [cell.strip().strip("`") for cell in line.strip("|").split("|")]
            rows.append((cells[0], cells[1], cells[2]))
    return rows


def _verl_source() -> str:
    package = Path(importlib.util.find_spec("verl").submodule_search_locations[0])
    return "\n".join(path.read_text(errors="replace") for path in sorted(package.rglob("*.py")))


def _in_verl(name: str, source: str) -> bool:
    """The name as a string literal, or built the way verl builds some: a prefix literal (``"actor/"``
    handed to ``rename_dict``, ``f"timing_s/{name}"``) and the last part as a literal (``"lr"``,
    ``marked_timer("gen", ...)``)."""
    prefix, _, last = name.rpartition("/")
    composed = (f'"{prefix}/"' in source or f'f"{prefix}/{{' in source) and f'"{last}"' in source
    return f'"{name}"' in source or composed


def test_every_verl_name_in_the_table_occurs_in_verls_source():
    rows = metric_table()
    assert rows[0] == ("reward/mean", "critic/score/mean", "train/reward")  # the parser reads the table
    source = _verl_source()
    names = [verl for _, verl, _ in rows if verl != "—"]
    missing = [name for name in names if not _in_verl(name, source)]
    assert not missing, f"not in verl's installed source: {missing}"
    assert not _in_verl("actor/pg_clipfrac_upper", source)  # a plausible name verl does not log
