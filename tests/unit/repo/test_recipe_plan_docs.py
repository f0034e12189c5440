"""The recipe plan tables of docs/memory.md and the GPU table of docs/recipes.md say what
``nemo-sspo plan`` says (a user read the recipes' GPU needs in two places that disagreed):
regenerate them with ``python tools/recipe_plans.py --write``."""

import re
from pathlib import Path

import pytest

from tools.recipe_plans import documented, plan_table

RECIPES_DOC = Path(__file__).resolve().parents[3] / "docs" / "recipes.md"


@pytest.mark.parametrize("name, gib, gpus, table", documented(), ids=lambda v: str(v)[:40])
def test_memory_doc_table_is_the_plan(name, gib, gpus, table):
    assert table == plan_table(name, gib, gpus), f"regenerate: python tools/recipe_plans.py --write ({name})"


def test_every_recipe_has_a_plan_table_and_the_recipes_page_quotes_its_peaks():
    tables = {(name, gib): table for name, gib, _, table in documented()}
    rows = re.findall(r"^\| `(\*?[\w.]+)` \|.*\| (—|[\d.]+ GiB) \| (—|[\d.]+ GiB) \|$", RECIPES_DOC.read_text(), re.M)
    assert len(rows) == 7, rows
    for recipe, peak_80, peak_141 in rows:
        name = recipe.replace("*", "sspo")  # the SSPO, GRPO and GSPO recipes share one layout
        for gib, peak in ((80.0, peak_80), (141.0, peak_141)):
            if peak == "—":
                assert (name, gib) not in tables
                continue
            quoted = re.search(r"^peak ([\d.]+ GiB) of", tables[name, gib], re.M).group(1)
            assert peak == quoted, (recipe, gib)
