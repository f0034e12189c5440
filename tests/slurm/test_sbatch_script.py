"""``examples/slurm/sspo.sbatch`` run as Slurm runs it, with stand-in ``scontrol`` and ``srun`` on PATH
and a stand-in Python: the launcher arguments each node's torchrun agent gets, for 1 and 2 nodes,
with and without a container image, and the refusal of more than one task per node.

The stand-in ``srun`` records its own arguments, then runs the script's per-task command once per
task with ``SLURM_PROCID`` set, as Slurm would on each node; the stand-in Python records the
launcher command it was given instead of starting torchrun. The real Slurm run of the same script is
``tests/slurm/test_slurm_check.py`` (where Slurm is installed).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration._launch import REPO

SCRIPT = REPO / "examples" / "slurm" / "sspo.sbatch"

_SCONTROL = """#!/bin/sh
# scontrol show hostnames a,b: one host a line
[ "$1 $2" = "show hostnames" ] || exit 1
echo "$3" | tr ',' '\\n'
"""

_SRUN = f"""#!{sys.executable}
import json, os, subprocess, sys
args = sys.argv[1:]
with open(os.environ["STANDIN_LOG"], "a") as log:
    log.write(json.dumps({{"srun": args}}) + "\\n")
command = args[args.index("bash"):]
tasks = int(next(a.split("=", 1)[1] for a in args if a.startswith("--ntasks=")))
for procid in range(tasks):
    subprocess.run(command, env={{**os.environ, "SLURM_PROCID": str(procid)}}, check=True)
"""

_PYTHON = f"""#!{sys.executable}
import json, os, sys
with open(os.environ["STANDIN_LOG"], "a") as log:
    log.write(json.dumps({{"python": sys.argv[1:], "procid": os.environ["SLURM_PROCID"]}}) + "\\n")
"""


def _standins(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", _SCONTROL), ("srun", _SRUN), ("python-standin", _PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _submit(tmp_path: Path, nodes: list[str], *train_args: str, **env: str) -> tuple[subprocess.CompletedProcess,
                                                                                  list[dict]]:
    """Runs the script as the batch step of job 4321 on ``nodes``; returns the run and the records."""
    bin_dir = _standins(tmp_path)
    log = tmp_path / "standin.jsonl"
    run_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "STANDIN_LOG": str(log), "SLURM_JOB_ID": "4321",
               "SLURM_JOB_NODELIST": ",".join(nodes), "SLURM_NNODES": str(len(nodes)),
               "NEMO_SSPO_PYTHON": str(bin_dir / "python-standin"), **env}
    run = subprocess.run(["bash", str(SCRIPT), *train_args], cwd=tmp_path, env=run_env, capture_output=True,
                         text=True, timeout=60)
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return run, records


def _launcher(nnodes: int, nproc: int, lead: int, is_host: int, *train_args: str) -> list[str]:
    # rendezvous on the first node at 29500 + job id mod 1000 = 29500 + 321
    return ["-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
            "--shutdown-timeout", str(lead), "--rdzv-backend", "c10d", "--rdzv-endpoint", "gpu-a:29821",
            "--rdzv-id", "4321", "--rdzv-conf", f"is_host={is_host}", "-m", "nemo_sspo.cli", "train", *train_args]


def _signal_lead() -> int:
    """The lead time of the script's own ``#SBATCH --signal=TERM@N`` line, in seconds."""
    return int(re.search(r"^#SBATCH --signal=TERM@(\d+)$", SCRIPT.read_text(), re.M).group(1))


def test_one_node_gives_its_workers_the_whole_stop_signal_lead(tmp_path):
    run, records = _submit(tmp_path, ["gpu-a"], "--config-name", "sspo_qwen2.5_math_1.5b")
    assert run.returncode == 0, run.stderr
    assert _signal_lead() == 600  # the header asks for SIGTERM 10 minutes before the time limit
    srun, launched = records
    # srun's options, then the per-task command (bash -c <script>) and its positional arguments
    assert srun["srun"][:5] == ["--kill-on-bad-exit=1", "--ntasks=1", "--ntasks-per-node=1", "bash", "-c"]
    assert srun["srun"][6:] == [str(tmp_path / "bin" / "python-standin"), "1", "8", "600", "gpu-a:29821", "4321",
                                "--config-name", "sspo_qwen2.5_math_1.5b"]
    assert launched == {"python": _launcher(1, 8, 600, 1, "--config-name", "sspo_qwen2.5_math_1.5b"), "procid": "0"}


def test_two_nodes_in_a_container_mount_the_submit_directory_and_one_agent_per_node_hosts(tmp_path):
    run, records = _submit(tmp_path, ["gpu-a", "gpu-b"], "--config-name", "sspo_qwen2.5_math_7b", "trainer.max_steps=5",
                           CONTAINER_IMAGE="nemo-sspo.sqsh", CONTAINER_MOUNTS="/lustre/data:/data,/lustre/hf:/hf",
                           SLURM_GPUS_ON_NODE="8", STOP_LEAD_S="900")
    assert run.returncode == 0, run.stderr
    srun = records[0]["srun"]
    assert srun[:9] == ["--kill-on-bad-exit=1", "--ntasks=2", "--ntasks-per-node=1",
                        "--container-image", "nemo-sspo.sqsh", "--container-workdir", str(tmp_path),
                        "--container-mounts", f"{tmp_path}:{tmp_path},/lustre/data:/data,/lustre/hf:/hf"]
    train = ("--config-name", "sspo_qwen2.5_math_7b", "trainer.max_steps=5")
    assert records[1:] == [{"python": _launcher(2, 8, 900, 1, *train), "procid": "0"},
                           {"python": _launcher(2, 8, 900, 0, *train), "procid": "1"}]


def test_a_container_without_extra_mounts_still_mounts_its_working_directory(tmp_path):
    run, records = _submit(tmp_path, ["gpu-a"], CONTAINER_IMAGE="nemo-sspo.sqsh", NPROC_PER_TASK="4")
    assert run.returncode == 0, run.stderr
    assert records[0]["srun"][3:9] == ["--container-image", "nemo-sspo.sqsh", "--container-workdir", str(tmp_path),
                                       "--container-mounts", f"{tmp_path}:{tmp_path}"]
    assert records[1] == {"python": _launcher(1, 4, 600, 1), "procid": "0"}


@pytest.mark.parametrize("tasks", ["16", "3"])
def test_more_than_one_task_per_node_is_refused_before_anything_starts(tasks, tmp_path):
    run, records = _submit(tmp_path, ["gpu-a", "gpu-b"], SLURM_NTASKS=tasks)
    assert run.returncode == 2
    assert f"{tasks} Slurm tasks on 2 node(s)" in run.stderr and "--ntasks-per-node=1" in run.stderr
    assert records == []  # srun never ran
