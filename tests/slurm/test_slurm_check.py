"""The real-Slurm check (``run_slurm_check.sh``: munged, slurmctld and slurmd started as a one-node
cluster, ``examples/slurm/sspo.sbatch`` submitted twice with one task of 2 workers, PP 2 and the
separate rollout placement, each job COMPLETED with 2 finite steps)
as a test, where Slurm is installed and the user is root (the script starts the daemons as root).

Skipped otherwise, naming what is missing: the suite installs no packages (the script would
apt-get them), so install ``slurm-wlm`` and ``munge`` first, e.g. by running the script by hand.
"""

import os
import shutil
import subprocess
import sys

import pytest

from tests.integration._launch import REPO, launch_env

SCRIPT = REPO / "tests" / "slurm" / "run_slurm_check.sh"
NEEDED = ("slurmctld", "slurmd", "sbatch", "sinfo", "scontrol", "munged", "mungekey", "munge", "unmunge")
"""Every Slurm and munge command the script runs; with one missing it would install packages."""


def _missing() -> str | None:
    absent = [name for name in NEEDED if shutil.which(name) is None]
    if absent:
        return f"Slurm is not installed here (no {', '.join(absent)} on PATH; apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "the Slurm check starts munged, slurmctld and slurmd as root; this user is not root"
    return None


@pytest.mark.slow
@pytest.mark.skipif(_missing() is not None, reason=str(_missing()))
def test_the_sbatch_script_completes_a_two_worker_job_under_a_real_slurm():
    run = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=launch_env(PYTHON=sys.executable),
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert run.stdout.count("NumTasks=1") == 2  # each job: one Slurm task, one torchrun agent of 2 workers
    for job in ("pp2", "separate"):  # pipeline parallel 2; one training rank + one rollout rank
        assert f"[slurm-check] {job}: metrics ok: 2 steps" in run.stdout, run.stdout[-4000:]
    assert run.stdout.count("JobState=COMPLETED") == 2 and "[slurm-check] PASS" in run.stdout
