"""docs/extending.md's reward, prompt source and rollout engine, loaded from the guide's own files,
train two steps in ``nemo-sspo train`` by config alone, on the tiny random model, which learns nothing
there (as the guide says)."""

import json

import pytest

from nemo_sspo.cli import main
from tests.integration._loop_runs import TINY
from tests.unit.repo.test_docs import guide_files, _module  # noqa: F401 - the fixture is used by name


@pytest.mark.slow
def test_guide_reward_engine_and_prompts_train_by_config_alone(guide_files, tmp_path):  # noqa: F811
    plugins = ",".join(str(guide_files[name]) for name in ("my_reward.py", "my_engine.py", "my_prompts.py"))
    out = tmp_path / "run"
    assert main(["train", f"plugins=[{plugins}]", "reward.name=exact_number", "rollout.engine.backend=timed_hf",
                 "data=countdown_schema", "data.options.start=7", *TINY, f"trainer.output_dir={out}"]) == 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    # What the guide says of model=tiny_random: every response runs to the 8-token cap and holds no
    # number, so exact_number scores all 0, every advantage is 0 and nothing is learned.
    for step in steps:
        assert step["response/truncated_frac"] == 1.0 and step["response/length_mean"] == 8.0
        assert step["reward/mean"] == 0.0 and step["reward/truncated_mean"] == 0.0
        assert step["advantages/zero_variance_group_frac"] == 1.0
        assert step["loss/policy"] == 0.0 and step["optim/grad_norm"] == 0.0
    # The guide's engine generated every group: 2 steps x 2 prompt groups, each timed.
    throughput = _module(guide_files["my_engine.py"]).THROUGHPUT
    assert len(throughput) == 4 and all(t > 0 for t in throughput)
