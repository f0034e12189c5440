"""A ``plugins=[...]`` module that injects one fault into a CLI run (tests/integration/test_save_signals.py,
tests/integration/test_kill_a_rank.py).

Registers the parity reward as ``test_parity`` (what tests.integration._loop_runs registers in the
test process: a CLI run does not import that module) and, chosen by ``NEMO_SSPO_TEST_FAULT``:

- ``save_signal``: the first checkpoint writer process that megatron-core forks for the save into
  ``.<NEMO_SSPO_TEST_FAULT_SAVE>.tmp`` (e.g. ``step_000002``) sends ``NEMO_SSPO_TEST_SIGNAL``
  (``SIGTERM`` or ``SIGKILL``) to the run's whole process group as it starts writing: the moment at
  which the save's helper processes (the spawned Manager and the forked writers) are all alive, as
  Slurm's SIGTERM to a job step, Ctrl-C in a terminal or the OOM killer would find them.
- ``kill_rank``: training rank ``NEMO_SSPO_TEST_FAULT_RANK`` (``RANK`` of its torchrun launch) kills
  itself with SIGKILL as its update of step ``NEMO_SSPO_TEST_FAULT_STEP`` begins: mid-step, after the
  step's rollout, with the other ranks inside the update's collectives.

The file named by ``NEMO_SSPO_TEST_SIGNAL_MARKER`` records that the fault happened (once per run
folder); when it already exists nothing is injected, so a resumed run with the same plugin runs clean.
"""

import os
import signal
import time

from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

from nemo_sspo.rewards import register_reward
from nemo_sspo.trainer import loop
from nemo_sspo.trainer.policy import Policy

REWARD = "test_parity"  # tests.integration._loop_runs.PARITY_REWARD


class _Parity:
    def __call__(self, responses, answers):
        return [float(len(r) % 2 == 0) for r in responses]

    def close(self):
        pass


register_reward(REWARD, lambda section: _Parity())  # _loop_runs.ParityReward's rule


def _first_time() -> bool:
    """Whether this is the run's first fault (creates the marker file atomically)."""
    try:
        os.close(os.open(os.environ["NEMO_SSPO_TEST_SIGNAL_MARKER"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


_write = FileSystemWriterAsync.write_preloaded_data


def _signal_then_write(*args, **kwargs):
    file_name = str(kwargs.get("write_bucket", args[2] if len(args) > 2 else ("",))[0])
    if f".{os.environ['NEMO_SSPO_TEST_FAULT_SAVE']}.tmp" in file_name and _first_time():
        os.killpg(os.getpgrp(), signal.Signals[os.environ["NEMO_SSPO_TEST_SIGNAL"]])
        time.sleep(0.5)  # every process of the group has the signal before the write goes on
    return _write(*args, **kwargs)


_train_step, _update = loop.GRPOTrainer.train_step, Policy.update
_STEP = [0]  # the step in progress


def _step_in_progress(self, step):
    _STEP[0] = step
    return _train_step(self, step)


def _die_mid_step(self, batch):
    if (os.environ.get("RANK") == os.environ["NEMO_SSPO_TEST_FAULT_RANK"]
            and _STEP[0] == int(os.environ["NEMO_SSPO_TEST_FAULT_STEP"]) and _first_time()):
        os.kill(os.getpid(), signal.SIGKILL)
    return _update(self, batch)


if os.environ.get("NEMO_SSPO_TEST_FAULT") == "save_signal":
    FileSystemWriterAsync.write_preloaded_data = staticmethod(_signal_then_write)
elif os.environ.get("NEMO_SSPO_TEST_FAULT") == "kill_rank":
    loop.GRPOTrainer.train_step, Policy.update = _step_in_progress, _die_mid_step
