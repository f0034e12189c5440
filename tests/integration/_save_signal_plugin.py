"""A ``plugins=[...]`` module for tests/integration/test_save_signals.py (imported by the CLI run).

Registers the parity reward as ``test_parity`` (what tests.integration._loop_runs registers in the
test process: this CLI run does not import that module) and makes the first checkpoint writer process
megatron-core forks send SIGTERM to the run's whole process group as it starts writing: the moment
at which the save's helper processes (the spawned Manager and the forked writers) are all alive, as
Slurm's SIGTERM to a job step or Ctrl-C in a terminal would find them. The file named by
``NEMO_SSPO_TEST_SIGNAL_MARKER`` records that the signal was sent (once per run folder); when it
already exists nothing is sent.
"""

import os
import signal
import time

from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

from nemo_sspo.rewards import register_reward

REWARD = "test_parity"  # tests.integration._loop_runs.PARITY_REWARD


class _Parity:
    def __call__(self, responses, answers):
        return [float(len(r) % 2 == 0) for r in responses]

    def close(self):
        pass


register_reward(REWARD, lambda section: _Parity())  # _loop_runs.ParityReward's rule

_write = FileSystemWriterAsync.write_preloaded_data


def _signal_then_write(*args, **kwargs):
    try:  # the first writer of the first save only
        os.close(os.open(os.environ["NEMO_SSPO_TEST_SIGNAL_MARKER"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        pass
    else:
        os.killpg(os.getpgrp(), signal.SIGTERM)
        time.sleep(0.5)  # every process of the group has the signal before the write goes on
    return _write(*args, **kwargs)


FileSystemWriterAsync.write_preloaded_data = staticmethod(_signal_then_write)
