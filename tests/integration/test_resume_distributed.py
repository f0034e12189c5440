"""Resume under tensor parallelism and with the distributed optimizer, with a learning-rate schedule:
TP=2, and DP=2 with Adam's states sharded, on 2 gloo processes launched by torchrun (the training
launcher; Megatron's checkpoint writer forks, which the daemonic workers of ``run_distributed`` may
not). The step after a resume from the step-2 checkpoint equals the uninterrupted run's step 3,
learning rate included; a resume with a changed peak, minimum and decay length runs at the rate
worked out by hand from this run's settings at the checkpoint's position. With the distributed optimizer this failed before the fix of Adam's step
counters on loading (``nemo_sspo/trainer/checkpoint.py``): the counter went back to 1 and step 3's
token ratios were about 1e-5 off."""

import json
import math

import pytest

from tests.integration._launch import torchrun_worker
from tests.integration._loop_runs import untimed


@pytest.mark.slow
def test_tp2_and_distributed_optimizer_resume_continue_with_identical_metrics(tmp_path):
    torchrun_worker("tests.integration._resume_worker", str(tmp_path))
    results = json.loads((tmp_path / "result.json").read_text())
    assert sorted(results) == ["dp2_distributed_optimizer", "tp2"]
    for name, result in results.items():
        straight, resumed, changed = (untimed(result[run]) for run in ("straight", "resumed", "changed"))
        assert straight["step"] == resumed["step"] == 3
        assert resumed == straight, name
        # update 6 of 6 (2 per step) under cosine decay from 2e-5 with warmup 2: r = (6 - 2) / (6 - 2) = 1
        assert straight["optim/lr"] == 1e-6
        first = json.loads((tmp_path / name / "straight" / "metrics.jsonl").read_text().splitlines()[0])
        assert math.isclose(first["optim/lr"], 2e-5)  # update 2 ends the warmup
        assert (tmp_path / name / "straight" / "checkpoints" / "step_000002" / "rng" / "rank_00001.pt").is_file()
        # Resumed with optim.lr=4e-5, min_lr=2e-6, lr_decay_steps=8 (allowed changes): update 6 at
        # r = (6 - 2) / (8 - 2) = 2/3 runs at 2e-6 + (4e-5 - 2e-6) (1 + cos(2 pi / 3)) / 2 = 2e-6 + 3.8e-5 / 4
        # = 1.15e-5 (before the fix: the checkpoint's bounds, 1e-6 + 1.9e-5 / 4 = 5.75e-6)
        assert changed["step"] == 3 and math.isclose(changed["optim/lr"], 1.15e-5, rel_tol=1e-9), name
