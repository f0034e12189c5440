"""The recipe plan tables of docs/memory.md, as ``nemo-sspo plan`` prints them (without its first note,
the model source's origin, which depends on the machine's cache).

    python tools/recipe_plans.py            # prints every table
    python tools/recipe_plans.py --write    # rewrites the tables in docs/memory.md

Each table sits in docs/memory.md under a heading ``### <config> on <GiB> GiB (<N> GPUs)`` in a fenced
block; ``tests/unit/repo/test_recipe_plan_docs.py`` fails when a table differs from the plan.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "memory.md"
HEADING = re.compile(r"^### (\S+) on ([\d.]+) GiB \((\d+) GPUs\)\n```\n(.*?)```\n", re.M | re.S)


def plan_table(config_name: str, gib: float, world_size: int) -> str:
    """The plan of ``config_name`` on ``world_size`` GPUs of ``gib`` GiB, from the model's published
    architecture, as ``nemo-sspo plan`` prints it."""
    from nemo_sspo.cli import load_config
    from nemo_sspo.models.published import published_config
    from nemo_sspo.trainer.memory_plan import format_memory_plan, memory_plan

    cfg = load_config(config_name, command="eval")  # the layout is checked by the plan's world size
    cfg.trainer.gpu_memory_gib = gib
    plan = memory_plan(cfg, published_config(cfg.model.source), world_size=world_size, gpu_gib=gib)
    return format_memory_plan(plan) + "\n"


def documented() -> list[tuple[str, float, int, str]]:
    """``(config, GiB, GPUs, table)`` of every table in docs/memory.md."""
    return [(m.group(1), float(m.group(2)), int(m.group(3)), m.group(4)) for m in HEADING.finditer(DOC.read_text())]


def main(argv: list[str]) -> int:
    text = DOC.read_text()
    for name, gib, gpus, _ in documented():
        table = plan_table(name, gib, gpus)
        if "--write" in argv:
            heading = f"### {name} on {gib:g} GiB ({gpus} GPUs)\n```\n"
            start = text.index(heading) + len(heading)
            text = text[:start] + table + text[text.index("```\n", start):]
        else:
            print(f"### {name} on {gib:g} GiB ({gpus} GPUs)\n{table}")
    if "--write" in argv:
        DOC.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
