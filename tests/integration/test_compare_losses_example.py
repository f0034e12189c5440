"""examples/compare_losses.py: the smoke command of its docstring, run as written except for the
reward (the tiny random model earns no math-verify reward, so every method would see zero advantages
and make no update), and a config its layout cannot split refused in one line before any training."""

import importlib.util
import json
import shlex
from pathlib import Path

import pytest

from tests.integration._loop_runs import PARITY_REWARD

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "compare_losses.py"


def _example():
    spec = importlib.util.spec_from_file_location("compare_losses", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def _documented_smoke_arguments(doc: str) -> list[str]:
    """The arguments of the docstring's command marked ``# smoke test`` (continued over ``\\`` lines)."""
    lines = doc.splitlines()
    end = next(i for i, line in enumerate(lines) if line.rstrip().endswith("# smoke test"))
    start = max(i for i in range(end + 1) if "python examples/compare_losses.py" in lines[i])
    text = " ".join(line.split("#")[0].strip().rstrip("\\") for line in lines[start:end + 1])
    words = shlex.split(text)
    return words[words.index("examples/compare_losses.py") + 1:]


@pytest.mark.slow
def test_documented_smoke_command_methods_clip_differently(tmp_path):
    example = _example()
    args = _documented_smoke_arguments(example.__doc__)
    args[args.index("--output-dir") + 1] = str(tmp_path)
    assert example.main([*args, f"reward.name={PARITY_REWARD}"]) == 0
    table = (tmp_path / "comparison.md").read_text()
    assert "identical responses and rewards for every method: yes" in table
    steps = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
             for name in example.LOSSES}
    assert all(len(history) == 1 for history in steps.values())
    # The same rollouts, so the same rewards; the methods differ only in their updates.
    assert len({history[0]["reward/mean"] for history in steps.values()}) == 1
    clip = {name: history[0]["policy/clipfrac_tokens"] for name, history in steps.items()}
    # Mini-batches 2-4 are off-policy. GSPO's band on the response's geometric-mean ratio,
    # [1 - 3e-4, 1 + 4e-4], is far inside GRPO's [0.8, 1.2] on each token's ratio, so the same drift
    # clips more of GSPO's tokens (measured: GSPO 0.125, the other three 0).
    assert clip["gspo"] > clip["grpo"], clip
    for name in ("compare_losses.png", "shared_rollouts_clipfrac.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_layout_error_is_one_line_before_training(tmp_path, capsys):
    """8 responses cannot make 4 mini-batches of micro-batches of 4: exit 2 with load_config's message."""
    example = _example()
    code = example.main(["--output-dir", str(tmp_path / "out"), "model=tiny_random", "rollout.samples_per_prompt=4"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [
        "compare_losses.py: invalid config 'sspo_smollm2_cpu': rollout.prompts_per_step x rollout.samples_per_prompt "
        "= 8 responses must split into "
        "trainer.minibatches_per_step (4) x data-parallel size (1) x parallel.micro_batch_size (4) = "
        "16-response units"]
    assert not (tmp_path / "out").exists()
