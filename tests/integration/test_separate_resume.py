"""A ``rollout.placement=separate`` run launched by torchrun (its own rendezvous store), resumed from
its step-1 checkpoint: the rollout rank replays the data position, takes the resumed weights and
says so, and step 2 equals the uninterrupted run's (every metric but timings)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_separate_resume_continues_with_identical_metrics(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
           "-m", "tests.integration._separate_resume_worker", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed after step 1: generation restarts from the resumed weights" in proc.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    straight, resumed = ({k: v for k, v in r.items() if not k.startswith(("timing/", "throughput/"))}  # wall-clock based
                         for r in (result["straight"], result["resumed"]))
    assert straight["step"] == resumed["step"] == 2
    assert straight["optim/grad_norm"] > 0  # a real update between the checkpoint and step 2
    assert resumed == straight
