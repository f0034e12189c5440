"""Stopping a run on SIGINT (Ctrl-C) or SIGTERM (what Slurm and torchrun send before SIGKILL).

Python's default SIGTERM action ends the process at once: no ``finally``, no ``atexit``. The
children it started then outlive it: Megatron's checkpoint writer keeps a multiprocessing Manager
(a spawned process that re-imports the trainer, about 280 MB) and multiprocessing's resource
tracker. :func:`stop_on_signals` turns both signals into :class:`RunInterrupted` in the main thread,
so the step in progress is abandoned, the loop saves what is safe (``GRPOTrainer.fit``), the reward
pool is closed and the interpreter exits normally, shutting those children down. A checkpoint save
in progress is finished first (:func:`deferred_signals`): its temporary folder would be left behind.

A signal to the whole process group (Ctrl-C in a terminal, Slurm's SIGTERM to a job step) also
reaches the save's own helper processes: the Manager that megatron-core spawns on the first save and
the writer processes it forks for every save. Killed, they take the checkpoint with them (the main
process reads ``EOFError`` from their queue and only ``.step_N.tmp`` is left). So during the block
the main thread also blocks both signals in its signal mask: processes forked or spawned there
inherit that mask and never see the signals, while the main process still records them (another
thread takes the delivery, or the mask's release does) and raises once the save is complete.
"""

from __future__ import annotations

import signal
import threading
from multiprocessing import resource_tracker
from contextlib import contextmanager
from pathlib import Path

from nemo_sspo.trainer.checkpoint import resolve_resume

__all__ = ["RunInterrupted", "deferred_signals", "stop_message", "stop_on_signals"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_pending: list[int] = []
_deferring = threading.Event()


class RunInterrupted(KeyboardInterrupt):
    """Raised in the main thread by SIGINT or SIGTERM inside :func:`stop_on_signals`.

    A ``KeyboardInterrupt``, so code that already cleans up on Ctrl-C does the same on SIGTERM.

    Args:
        signum: the signal number received.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.signal_name = signal.Signals(signum).name
        super().__init__(self.signal_name)

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal: 128 + its number (130, 143)."""
        return 128 + self.signum


def _handle(signum: int, _frame) -> None:
    if _deferring.is_set():
        _pending.append(signum)
        return
    raise RunInterrupted(signum)


@contextmanager
def stop_on_signals():
    """Within the block, SIGINT and SIGTERM raise :class:`RunInterrupted` (main thread only; elsewhere
    the block runs with the handlers unchanged). The previous handlers are restored on exit.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _handle) for signum in _SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _pending.clear()


@contextmanager
def deferred_signals():
    """A signal arriving within the block is held until the block ends, then raised (a save that
    must not stop half way).

    In the main thread SIGINT and SIGTERM are also blocked in the signal mask for the duration, so
    every process started within the block (megatron-core's checkpoint Manager and writers) inherits
    a mask that keeps them from being killed by a signal sent to the whole process group. A held
    signal is raised as :class:`RunInterrupted` when the block ends (inside :func:`stop_on_signals`).
    """
    main = threading.current_thread() is threading.main_thread()
    if main:
        # multiprocessing starts its resource tracker (on the first spawned process, such as that
        # Manager) between a block and an *unblock* of these very signals, which would clear ours:
        # start it now, so that it is already running inside the block.
        resource_tracker.ensure_running()
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS) if main else None
    _deferring.set()
    try:
        yield
    finally:
        if previous_mask is not None:  # a signal held by the mask runs the handler here, while deferring
            signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
        _deferring.clear()
    if _pending:
        signum = _pending[0]
        _pending.clear()
        raise RunInterrupted(signum)


def stop_message(err: RunInterrupted, *, completed_steps: int | None, output_dir: str | Path,
                 interrupted_dir: Path | None, policy_step: int | None = None) -> str:
    """The one line printed when a run stops on a signal: which step was abandoned and what is on
    disk to continue from.

    Args:
        err: the interruption.
        completed_steps: steps finished (and logged) before it; None while the trainer was starting.
        output_dir: ``trainer.output_dir``.
        interrupted_dir: the policy folder written on the way out, or None.
        policy_step: the step whose update that folder holds.
    """
    saved = []
    if interrupted_dir is not None:
        saved.append(f"the policy after step {policy_step} in {interrupted_dir}")
    try:
        checkpoint = resolve_resume("auto", output_dir)
    except ValueError:  # ``latest`` names an incomplete folder: nothing to offer
        checkpoint = None
    if checkpoint is not None:
        saved.append(f"resumable checkpoint {checkpoint} (continue with trainer.resume=auto)")
    what = "; ".join(saved) if saved else "nothing resumable (trainer.checkpoint_interval=0 or no checkpoint yet)"
    when = ("while starting" if completed_steps is None else
            f"in step {completed_steps + 1} (abandoned; {completed_steps} steps in {Path(output_dir) / 'metrics.jsonl'})")
    return f"stopped by {err.signal_name} {when}; saved: {what}"
