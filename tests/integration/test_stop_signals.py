"""SIGTERM (what Slurm and torchrun send) and Ctrl-C (SIGINT to the whole process group) stop a CLI
run cleanly: the step in progress is abandoned, the last completed policy and checkpoint stay on
disk, one line says so, and no process of the run is left (before, SIGTERM left Megatron's
checkpoint-writer Manager, ~280 MB, and multiprocessing's resource tracker behind; Ctrl-C could hang
on a pool worker killed while holding its queue lock)."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.integration.test_train_loop import TINY


def _live_processes(pgid: int) -> list[str]:
    """Processes of the process group that are not zombies (exited, waiting for init to reap them)."""
    ps = subprocess.run(["ps", "-o", "pid=,stat=,args=", "-g", str(pgid)], capture_output=True, text=True)
    return [line for line in ps.stdout.splitlines() if line.split()[1][0] != "Z"]


def _wait_for_steps(out, steps: int, proc, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    metrics = out / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.2)
    raise AssertionError(f"{steps} steps not logged in {timeout_s} s")


@pytest.mark.slow
@pytest.mark.parametrize("signum, to_group", [(signal.SIGTERM, False), (signal.SIGINT, True)])
def test_stop_signal_saves_what_is_safe_and_leaves_no_process(tmp_path, signum, to_group):
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    args = [*TINY, "trainer.max_steps=50", "trainer.checkpoint_interval=2", f"trainer.output_dir={out}"]
    proc = subprocess.Popen([sys.executable, "-m", "nemo_sspo.cli", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path, start_new_session=True)
    try:
        _wait_for_steps(out, 3, proc)  # step 2 saved a checkpoint (its Manager process runs); step 4 is under way
        (os.killpg if to_group else os.kill)(proc.pid, signum)
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 128 + signum, stderr[-3000:]  # 143 for SIGTERM, 130 for SIGINT
        deadline = time.monotonic() + 30  # the forkserver leaves once it sees the trainer gone
        while _live_processes(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _live_processes(proc.pid) == []
    finally:
        if _live_processes(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    done = len((out / "metrics.jsonl").read_text().splitlines())
    lines = [line for line in stderr.splitlines() if line.startswith("nemo-sspo: stopped by")]
    assert len(lines) == 1, stderr[-3000:]
    # The policy saved is the rollout engine's: after step `done`, or after the abandoned step when
    # the signal came between its refit and its record.
    policy = re.search(r"saved: the policy after step (\d+) in ", lines[0])
    assert policy and int(policy.group(1)) in (done, done + 1), lines[0]
    assert lines[0] == (
        f"nemo-sspo: stopped by {signal.Signals(signum).name} in step {done + 1} (abandoned; {done} steps in "
        f"{out / 'metrics.jsonl'}); saved: the policy after step {policy.group(1)} in "
        f"{out / 'hf_checkpoint_interrupted'}; resumable checkpoint "
        f"{out / 'checkpoints' / f'step_{done - done % 2:06d}'} (continue with trainer.resume=auto)")
    assert "Traceback" not in stderr
    assert json.loads((out / "hf_checkpoint_interrupted" / "config.json").read_text())["num_hidden_layers"] == 2
