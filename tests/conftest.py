"""The suite's tiers.

Everything under tests/distributed, tests/integration and tests/vllm spawns processes, trains a
model or starts an engine, so it is marked ``slow`` here unless marked ``fast`` (a few quick ones that
keep the multi-process modules in the fast tier). ``pytest -m "not slow and not soak"`` is the fast
tier; the whole suite (what .ci/run runs) runs everything.
"""

from pathlib import Path

import pytest

_HEAVY = {"distributed", "integration", "vllm"}


def pytest_collection_modifyitems(items):
    for item in items:
        if Path(item.fspath).parent.name in _HEAVY and item.get_closest_marker("fast") is None:
            item.add_marker(pytest.mark.slow)
