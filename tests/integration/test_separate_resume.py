"""A ``rollout.placement=separate`` run launched by torchrun (its own rendezvous store), resumed from
its step-1 checkpoint: the rollout rank replays the data position, takes the resumed weights and
says so, and step 2 equals the uninterrupted run's (every metric but timings)."""

import json
import subprocess

import pytest

from tests.integration._launch import REPO, TORCHRUN, free_port, launch_env


@pytest.mark.slow
def test_separate_resume_continues_with_identical_metrics(tmp_path):
    cmd = [*TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "tests.integration._separate_resume_worker", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed after step 1: generation restarts from the resumed weights" in proc.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    straight, resumed = ({k: v for k, v in r.items() if not k.startswith(("timing/", "throughput/"))}  # wall-clock based
                         for r in (result["straight"], result["resumed"]))
    assert straight["step"] == resumed["step"] == 2
    assert straight["optim/grad_norm"] > 0  # a real update between the checkpoint and step 2
    assert resumed == straight
