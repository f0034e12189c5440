"""A signal to the whole process group while a checkpoint is being saved (issue 32).

Ctrl-C in a terminal and Slurm's SIGTERM to a job step reach every process of the group, the save's
helpers included: megatron-core's spawned Manager and the writer processes it forks. Before, they
died with the signal, the run exited 1 with a traceback from the writer's queue and only
``.step_000002.tmp`` was left. Now the save completes, ``latest`` names it, the run exits 143 with
one line, and ``trainer.resume=auto`` continues to the same metrics as a run never stopped.

One CLI run in its own process group is signalled (from inside its step-2 save, by
``_save_signal_plugin.py``); the resumed run and the uninterrupted reference run in this process
(one thread, as the CLI run) with the same reward rule.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemo_sspo.models import load_hf_checkpoint
from tests.integration._loop_runs import PARITY_REWARD, TINY, run

PLUGIN = Path(__file__).with_name("_save_signal_plugin.py")
SHARED = ["trainer.max_steps=3", "trainer.checkpoint_interval=2", f"reward.name={PARITY_REWARD}",
          "trainer.loggers=[console,jsonl]"]


def _by_step(path: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(("timing/", "throughput/"))} for r in records}


@pytest.mark.slow
def test_group_sigterm_during_a_save_keeps_it_and_resume_equals_an_uninterrupted_run(monkeypatch, tmp_path):
    out, marker = tmp_path / "run", tmp_path / "signal_sent"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "NEMO_SSPO_TEST_SIGNAL_MARKER": str(marker)}
    stopped = subprocess.run(
        [sys.executable, "-m", "nemo_sspo.cli", "train", *TINY, *SHARED, f"plugins=[{PLUGIN}]",
         f"trainer.output_dir={out}"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
        start_new_session=True)  # its own process group: the signal reaches the run and nothing else
    assert marker.exists()  # the signal was sent, from inside the step-2 save
    assert stopped.returncode == 143, stopped.stderr[-3000:]  # 128 + SIGTERM, not 1
    assert "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    lines = [line for line in stopped.stderr.splitlines() if line.startswith("nemo-sspo: stopped by")]
    ckpts = out / "checkpoints"
    assert lines == [f"nemo-sspo: stopped by SIGTERM in step 3 (abandoned; 2 steps in {out / 'metrics.jsonl'}); "
                     f"saved: resumable checkpoint {ckpts / 'step_000002'} (continue with trainer.resume=auto)"]
    assert (ckpts / "latest").read_text() == "step_000002"
    assert (ckpts / "step_000002" / "trainer_state.json").is_file()
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000002"]  # no .step_000002.tmp left

    tiny = load_hf_checkpoint("tiny-random-llama")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run(monkeypatch, out, [*SHARED, "trainer.resume=auto"], checkpoint=tiny)
        # The reference starts in a folder left by a job stopped before its first checkpoint:
        # trainer.resume=auto moves that aside and starts fresh (issue 32, item 3).
        (tmp_path / "straight").mkdir()
        (tmp_path / "straight" / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 9.0}\n')
        run(monkeypatch, tmp_path / "straight", [*SHARED, "trainer.resume=auto", "trainer.overwrite_output_dir=false"],
            checkpoint=tiny)
    finally:
        torch.set_num_threads(threads)
    want, got = _by_step(tmp_path / "straight" / "metrics.jsonl"), _by_step(out / "metrics.jsonl")
    assert sorted(got) == [1, 2, 3] and got == want
    assert (tmp_path / "straight" / "earlier_run_1" / "metrics.jsonl").read_text() == '{"step": 1, "reward/mean": 9.0}\n'
