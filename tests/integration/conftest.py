"""Fixtures for integration tests: the multi-process gloo runner of tests/distributed."""

from tests.distributed.conftest import run_distributed  # noqa: F401  (re-exported fixture)
