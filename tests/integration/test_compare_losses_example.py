"""examples/compare_losses.py end to end on the tiny random model (2 losses, 1 step, stub reward):
the same step-1 rollouts for every method, the tables and the plots."""

import importlib.util
import json
from pathlib import Path

import pytest

from tests.integration._loop_runs import PARITY_REWARD

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "compare_losses.py"


@pytest.mark.slow
def test_compare_losses_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("compare_losses", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--losses", "grpo", "sspo", "--steps", "1", "--output-dir", str(tmp_path),
                         f"reward.name={PARITY_REWARD}", "model=tiny_random", "data.template=qwen-math", "rollout.max_new_tokens=8"]) == 0
    table = (tmp_path / "comparison.md").read_text()
    assert "identical responses and rewards for every method: yes" in table
    assert "| grpo |" in table and "| sspo |" in table
    runs = json.loads((tmp_path / "comparison.json").read_text())["runs"]
    # Same rollouts, so the same rewards; the methods differ only in their updates.
    assert runs["grpo"][0]["reward/mean"] == runs["sspo"][0]["reward/mean"]
    for name in ("compare_losses.png", "shared_rollouts_clipfrac.png"):
        assert (tmp_path / name).stat().st_size > 0
