"""The suite's tiers.

Everything under tests/distributed, tests/integration and tests/vllm spawns processes, trains a
model or starts an engine, so it is marked ``slow`` here unless marked ``fast`` (a few quick ones that
keep the multi-process modules in the fast tier). ``pytest -m "not slow and not soak"`` is the fast
tier; the whole suite (what .ci/run runs) runs everything.
"""

from pathlib import Path

import pytest

_HEAVY = {"distributed", "integration", "vllm"}


def pytest_configure(config):
    """The third-party warnings the product silences are silenced here too (one list, with reasons:
    nemo_sspo/known_warnings.py); every other warning shows in the summary."""
    from nemo_sspo.known_warnings import KNOWN_WARNINGS

    for known in KNOWN_WARNINGS:
        config.addinivalue_line("filterwarnings", known.pytest_filter())


def pytest_collection_modifyitems(items):
    for item in items:
        if Path(item.fspath).parent.name in _HEAVY and item.get_closest_marker("fast") is None:
            item.add_marker(pytest.mark.slow)
