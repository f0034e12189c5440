"""A run's phases per rank over wall time: ``timeline.png`` beside ``reward_entropy.png``.

The windows themselves go to ``timeline.jsonl`` (lane, phase, step, start, end in unix seconds).

Training rank 0 records its own phases of every step (waiting for / generating the rollout,
training, refit, a checkpoint save) and the generation window of every rollout it trains on or drops for staleness
(``dropped``), which the rollout rank measured (``placement: separate``; colocated, the same rank
generated it). Both come from ``time.time()`` on one host, or on hosts whose clocks agree to well
under a phase.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Timeline"]

_COLORS = {"generation": "C0", "dropped": "C5", "wait": "0.8", "train": "C1", "critic": "C3", "refit": "C2",
           "checkpoint": "C6"}


@dataclass
class Timeline:
    """Phase windows per lane.

    Attributes:
        events: ``(lane, phase, step, start, end)`` tuples, unix seconds; ``step`` is the training
            step the window belongs to (for a generation window: the step its rollout trains).
    """

    events: list[tuple[str, str, int, float, float]] = field(default_factory=list)

    def add(self, lane: str, phase: str, step: int, start: float, end: float) -> None:
        """Records one window of ``phase`` on ``lane`` (e.g. ``"training ranks"``, ``"rollout rank"``)."""
        self.events.append((lane, phase, step, start, end))

    def write(self, folder: Path) -> None:
        """Saves ``timeline.jsonl`` and ``timeline.png`` in ``folder``; nothing when empty."""
        if not self.events:
            return
        with open(folder / "timeline.jsonl", "w") as f:
            for lane, phase, step, start, end in self.events:
                f.write(json.dumps({"lane": lane, "phase": phase, "step": step, "start": start, "end": end}) + "\n")
        self.plot(folder / "timeline.png")

    def plot(self, path: Path) -> None:
        """Saves the timeline as a PNG (one row per lane, one colour per phase); nothing when empty."""
        if not self.events:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        origin = min(start for _, _, _, start, _ in self.events)
        lanes = list(dict.fromkeys(lane for lane, *_ in self.events))
        fig, ax = plt.subplots(figsize=(10, 1.0 + 0.6 * len(lanes)))
        for row, lane in enumerate(lanes):
            for name, phase, _, start, end in self.events:
                if name == lane:
                    ax.broken_barh([(start - origin, end - start)], (row - 0.35, 0.7),
                                   color=_COLORS.get(phase, "C4"), label=phase)
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles, strict=True))
        ax.legend(unique.values(), unique.keys(), loc="upper right", ncols=len(unique), fontsize=8)
        ax.set(yticks=range(len(lanes)), yticklabels=lanes, xlabel="wall time (s)", ylim=(-0.6, len(lanes) + 0.2),
               title="Phases per rank")
        ax.grid(axis="x", alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
