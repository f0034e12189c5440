"""One training rank of a torchrun launch killed with SIGKILL in the middle of a step (the OOM killer,
a GPU fault): torchrun ends the launch, and a second launch with ``trainer.resume=auto`` continues
from the last checkpoint to the same metrics as a launch never interrupted.

Two ranks (data-parallel 2) through the CLI, as a user launches them; rank 1 kills itself as its
update of step 2 begins (``_fault_plugin.py``), rank 0 being inside the update's collectives.
"""

import subprocess
from pathlib import Path

import pytest

from tests.integration._launch import REPO, TORCHRUN, free_port, launch_env
from tests.integration._loop_runs import PARITY_REWARD, TINY, records_by_step

PLUGIN = Path(__file__).with_name("_fault_plugin.py")
LAUNCH = [*TINY, "rollout.prompts_per_step=4", "trainer.checkpoint_interval=1", f"reward.name={PARITY_REWARD}",
          "trainer.loggers=[jsonl]", f"plugins=[{PLUGIN}]"]


def _launch(out: Path, *overrides: str, fault: bool = False) -> subprocess.CompletedProcess:
    env = launch_env(NEMO_SSPO_TEST_SIGNAL_MARKER=str(out.parent / f"{out.name}_killed"))
    if fault:
        env.update(NEMO_SSPO_TEST_FAULT="kill_rank", NEMO_SSPO_TEST_FAULT_RANK="1", NEMO_SSPO_TEST_FAULT_STEP="2")
    cmd = [*TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "nemo_sspo.cli", "train", *LAUNCH, f"trainer.output_dir={out}", *overrides]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_rank_killed_mid_step_then_resume_auto_equals_an_uninterrupted_launch(tmp_path):
    out = tmp_path / "run"
    killed = _launch(out, fault=True)
    assert (tmp_path / "run_killed").exists()  # rank 1 killed itself in step 2
    assert killed.returncode != 0
    assert "exitcode  : -9" in killed.stderr, killed.stderr[-3000:]  # torchrun reports the killed rank
    assert (out / "checkpoints" / "latest").read_text() == "step_000001"
    assert sorted(records_by_step(out / "metrics.jsonl")) == [1]

    resumed = _launch(out, "trainer.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    straight = _launch(tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    got, want = records_by_step(out / "metrics.jsonl"), records_by_step(tmp_path / "straight" / "metrics.jsonl")
    assert sorted(got) == [1, 2] and got == want
