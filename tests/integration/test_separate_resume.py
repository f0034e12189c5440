"""A ``rollout.schedule.placement=separate`` run launched by torchrun (its own rendezvous store), resumed from
its step-1 checkpoint: the rollout rank replays the data position, takes the resumed weights and
says so, and step 2 equals the uninterrupted run's (every metric but timings)."""

import json

import pytest

from tests.integration._launch import torchrun_worker
from tests.integration._loop_runs import untimed


@pytest.mark.slow
def test_separate_resume_continues_with_identical_metrics(tmp_path):
    proc = torchrun_worker("tests.integration._separate_resume_worker", str(tmp_path), timeout_s=300)
    assert "resumed after step 1: generation restarts from the resumed weights" in proc.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    straight, resumed = untimed(result["straight"]), untimed(result["resumed"])  # wall-clock values left out
    assert straight["step"] == resumed["step"] == 2
    assert straight["optim/grad_norm"] > 0  # a real update between the checkpoint and step 2
    assert resumed == straight
