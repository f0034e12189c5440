"""A signal to the whole process group while a checkpoint is being saved (issues 31 and 32).

Ctrl-C in a terminal and Slurm's SIGTERM to a job step reach every process of the group, the save's
helpers included: megatron-core's spawned Manager and the writer processes it forks. Before, they
died with the signal, the run exited 1 with a traceback from the writer's queue and only
``.step_000002.tmp`` was left. Now the save completes, ``latest`` names it, the run exits 143 with
one line, and ``trainer.resume=auto`` continues to the same metrics as a run never stopped.

SIGKILL (the OOM killer, a node lost) cannot be deferred: it ends every process of the run in the
middle of the write. ``latest`` still names the previous complete checkpoint, and
``trainer.resume=auto`` continues from it to the same metrics as a run never stopped, the step
logged after that checkpoint replaced and the half-written folder cleared.

Each CLI run has its own process group and is signalled from inside its step-2 save by
``_fault_plugin.py``; the resumed runs and the uninterrupted reference run in this process (one
thread, as the CLI runs) with the same reward rule.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemo_sspo.models import load_hf_checkpoint
from tests.integration._loop_runs import PARITY_REWARD, TINY, records_by_step, run

PLUGIN = Path(__file__).with_name("_fault_plugin.py")
SHARED = ["trainer.max_steps=3", "trainer.checkpoint_interval=2", f"reward.name={PARITY_REWARD}",
          "trainer.loggers=[console,jsonl]"]


def _signalled_cli_run(tmp_path: Path, signal_name: str, overrides: list[str]) -> subprocess.CompletedProcess:
    """A CLI run into ``tmp_path/run`` whose step-2 save signals the run's process group."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "NEMO_SSPO_TEST_FAULT": "save_signal",
           "NEMO_SSPO_TEST_FAULT_SAVE": "step_000002", "NEMO_SSPO_TEST_SIGNAL": signal_name,
           "NEMO_SSPO_TEST_SIGNAL_MARKER": str(tmp_path / "signal_sent")}
    stopped = subprocess.run(
        [sys.executable, "-m", "nemo_sspo.cli", "train", *TINY, *SHARED, *overrides, f"plugins=[{PLUGIN}]",
         f"trainer.output_dir={tmp_path / 'run'}"], capture_output=True, text=True, env=env, cwd=tmp_path,
        timeout=600, start_new_session=True)  # its own process group: the signal reaches the run and nothing else
    assert (tmp_path / "signal_sent").exists()  # the signal was sent, from inside the step-2 save
    return stopped


def _in_this_process(monkeypatch, out: Path, overrides: list[str]) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run(monkeypatch, out, [*SHARED, *overrides], checkpoint=load_hf_checkpoint("tiny-random-llama"))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, dict]:
    """The reference run's records by step. It starts in a folder left by a job stopped before its
    first checkpoint: trainer.resume=auto moves that aside and starts fresh (issue 32, item 3)."""
    straight = tmp_path_factory.mktemp("straight")
    (straight / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 9.0}\n')
    with pytest.MonkeyPatch.context() as monkeypatch:
        _in_this_process(monkeypatch, straight, ["trainer.resume=auto", "trainer.overwrite_output_dir=false"])
    assert (straight / "earlier_run_1" / "metrics.jsonl").read_text() == '{"step": 1, "reward/mean": 9.0}\n'
    return records_by_step(straight / "metrics.jsonl")


@pytest.mark.slow
def test_group_sigterm_during_a_save_keeps_it_and_resume_equals_an_uninterrupted_run(monkeypatch, tmp_path,
                                                                                       uninterrupted):
    stopped, out = _signalled_cli_run(tmp_path, "SIGTERM", []), tmp_path / "run"
    assert stopped.returncode == 143, stopped.stderr[-3000:]  # 128 + SIGTERM, not 1
    assert "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    lines = [line for line in stopped.stderr.splitlines() if line.startswith("nemo-sspo: stopped by")]
    ckpts = out / "checkpoints"
    assert lines == [f"nemo-sspo: stopped by SIGTERM in step 3 (abandoned; 2 steps in {out / 'metrics.jsonl'}); "
                     f"saved: resumable checkpoint {ckpts / 'step_000002'} (continue with trainer.resume=auto)"]
    assert (ckpts / "latest").read_text() == "step_000002"
    assert (ckpts / "step_000002" / "trainer_state.json").is_file()
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000002"]  # no .step_000002.tmp left

    _in_this_process(monkeypatch, out, ["trainer.resume=auto"])
    got = records_by_step(out / "metrics.jsonl")
    assert sorted(got) == [1, 2, 3] and got == uninterrupted


@pytest.mark.slow
def test_group_sigkill_during_a_save_resumes_from_the_previous_checkpoint_as_if_uninterrupted(monkeypatch, tmp_path,
                                                                                               uninterrupted):
    every_step = ["trainer.checkpoint_interval=1"]
    killed, out = _signalled_cli_run(tmp_path, "SIGKILL", every_step), tmp_path / "run"
    assert killed.returncode == -9, killed.stderr[-3000:]
    ckpts = out / "checkpoints"
    # Killed inside the step-2 write: its folder is half-written, latest still names step 1, and step 2's
    # record (logged before its save) is in metrics.jsonl without a checkpoint behind it.
    assert (ckpts / "latest").read_text() == "step_000001"
    assert sorted(p.name for p in ckpts.iterdir()) == [".step_000002.tmp", "latest", "step_000001"]
    assert not (ckpts / ".step_000002.tmp" / "trainer_state.json").exists()
    assert sorted(records_by_step(out / "metrics.jsonl")) == [1, 2]

    _in_this_process(monkeypatch, out, [*every_step, "trainer.resume=auto"])
    got = records_by_step(out / "metrics.jsonl")
    assert sorted(got) == [1, 2, 3] and got == uninterrupted
    assert (ckpts / "latest").read_text() == "step_000003"
    assert not (ckpts / ".step_000002.tmp").exists()
