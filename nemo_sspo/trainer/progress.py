"""Progress inside a step, for a person watching a run: one line per phase, throttled.

A step of a 7B run takes minutes (generation, scoring, the old and reference log-probs, the update,
the refit, a checkpoint save), and the per-step line comes only at its end. :class:`StepProgress`
prints ``step 3/12 [41 s]: generation, 24/64 responses`` style lines to stderr on the logging rank:
the phases the trainer and the sampler report (the update's micro-batches through
``on_micro_batch`` of :func:`nemo_sspo.megatron.training.train_on_batch`), at most one line per ``trainer.progress_interval_s``
seconds (so a batch job's log stays small: at the default 15 s, four lines a minute at most), and
nothing for a step shorter than that. ``trainer.progress_interval_s=0`` turns it off.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

from tqdm import tqdm

__all__ = ["StepProgress"]


class StepProgress:
    """Throttled phase lines of the running step (module docstring).

    Args:
        enabled: False on every rank but the logging one (nothing is printed).
        interval_s: the least time between two lines, and before a step's first; 0 disables.
        total_steps: the run's last step (shown as ``step t/T``).
        stream: where lines go (stderr).
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, *, enabled: bool, interval_s: float, total_steps: int, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Takes the settings (class docstring)."""
        self.enabled = enabled and interval_s > 0
        self.interval_s, self.total_steps = interval_s, total_steps
        self.stream, self.clock = stream or sys.stderr, clock
        self.step, self._step_start, self._last_line = 0, 0.0, 0.0
        self._current = ""

    def start_step(self, step: int) -> None:
        """A new step begins (its clock starts; no line)."""
        self.step = step
        self._step_start = self._last_line = self.clock()

    def phase(self, name: str, done: int | None = None, total: int | None = None, unit: str = "") -> None:
        """The step is in phase ``name`` (with ``done`` of ``total`` ``unit`` when given): prints one line
        if at least ``interval_s`` passed since the step began or since the last line.
        """
        self._current = f"{name}, {done}/{total} {unit}".rstrip() if total is not None else name
        self._show(self._current)

    def micro_batch(self, done: int, total: int) -> None:
        """Micro-batch ``done`` of ``total`` of the current phase starts (``on_micro_batch`` of
        :func:`nemo_sspo.megatron.training.train_on_batch`); throttled as :meth:`phase`.
        """
        self._show(f"{self._current}, {done}/{total} micro-batches")

    def _show(self, what: str) -> None:
        if not self.enabled:
            return
        now = self.clock()
        if now - self._last_line < self.interval_s:
            return
        self._last_line = now
        # tqdm.write: above the console logger's progress bar, not into it
        tqdm.write(f"step {self.step}/{self.total_steps} [{now - self._step_start:.0f} s]: {what}", file=self.stream)
