"""A long run of the tiny model that samples the process's resident memory, open files and child
processes after every step (the soak tier, docs/pitfalls.md#soak-leaks).

The run is the loop tests' tiny random Llama (``tests/integration/_loop_runs.py``) with the real
math-verify reward pool (its forkserver and a worker: child processes that a leak would multiply),
a checkpoint every 5 steps keeping 2 (dist_checkpointing's Manager process and its writer
processes, temporary files) and the jsonl/TensorBoard loggers. Every figure comes from ``/proc``
(Linux): ``VmRSS`` of ``/proc/self/status``, the entries of ``/proc/self/fd``, and the processes
whose parent chain reaches this one.

Local command (the measured table of docs/performance.md holds its figures)::

    OMP_NUM_THREADS=1 .venv/bin/python -m tests.integration._soak --steps 200 --out /tmp/soak
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

WARM_UP_STEPS = 5
"""Steps whose growth is expected (allocator pools, lazy imports, the checkpoint writer's Manager)."""


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError("no VmRSS in /proc/self/status")


def _children() -> int:
    """Live descendants of this process (zombies are counted: an unreaped child is a leak too)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    me, found = os.getpid(), 0
    for pid in parents:
        ancestor = parents.get(pid)
        while ancestor and ancestor != me:
            ancestor = parents.get(ancestor)
        found += ancestor == me
    return found


@dataclass(frozen=True)
class Sample:
    """The process after one step: ``step``, resident memory (MiB), open file descriptors, descendants."""

    step: int
    rss_mib: float
    open_fds: int
    children: int


def soak_run(monkeypatch, out: Path, steps: int) -> list[Sample]:
    """Runs ``steps`` steps into ``out`` and returns one :class:`Sample` per step, taken after the
    step's log and checkpoint. ``monkeypatch``: a pytest ``MonkeyPatch`` (the loop helpers take one)."""
    from nemo_sspo.models import load_hf_checkpoint
    from nemo_sspo.rewards import MathVerifyReward
    from tests.integration._loop_runs import run

    samples: list[Sample] = []

    def capture(trainer):
        inner = trainer.maybe_checkpoint

        def wrapped(step):
            inner(step)
            samples.append(Sample(step, _rss_mib(), len(os.listdir("/proc/self/fd")), _children()))

        trainer.maybe_checkpoint = wrapped

    run(monkeypatch, out, [f"trainer.max_steps={steps}", "trainer.checkpoint_interval=5", "trainer.keep_checkpoints=2",
                           "trainer.loggers=[jsonl,tensorboard]"],
        checkpoint=load_hf_checkpoint("tiny-random-llama"),
        reward=lambda: MathVerifyReward(num_workers=1, timeout_s=5.0), capture=capture)
    return samples


def rss_slope_mib_per_step(samples: list[Sample]) -> float:
    """Least-squares slope of resident memory over the steps after warm-up, MiB per step."""
    after = samples[WARM_UP_STEPS - 1:]
    n = len(after)
    mean_x = sum(s.step for s in after) / n
    mean_y = sum(s.rss_mib for s in after) / n
    num = sum((s.step - mean_x) * (s.rss_mib - mean_y) for s in after)
    return num / sum((s.step - mean_x) ** 2 for s in after)


def report(samples: list[Sample]) -> str:
    """The figures the table of docs/performance.md quotes: values at the end of warm-up and at the last step."""
    warm, last = samples[WARM_UP_STEPS - 1], samples[-1]
    after = samples[WARM_UP_STEPS - 1:]
    return (f"soak: {len(samples)} steps; after warm-up (step {warm.step}) -> step {last.step}: "
            f"RSS {warm.rss_mib:.0f} -> {last.rss_mib:.0f} MiB (max {max(s.rss_mib for s in after):.0f}, "
            f"slope {rss_slope_mib_per_step(samples):+.3f} MiB/step), open fds {warm.open_fds} -> {last.open_fds} "
            f"(range {min(s.open_fds for s in after)}-{max(s.open_fds for s in after)}), child processes "
            f"{warm.children} -> {last.children} (range {min(s.children for s in after)}-"
            f"{max(s.children for s in after)})")


def main() -> None:
    """``python -m tests.integration._soak --steps 200 --out DIR [--samples FILE]``: prints one line per
    10 steps and the figures; ``--samples`` also writes every sample as a JSON list."""
    import json

    import pytest

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("/tmp/nemo_sspo_soak"))
    parser.add_argument("--samples", type=Path, default=None)
    args = parser.parse_args()
    with pytest.MonkeyPatch.context() as monkeypatch:
        samples = soak_run(monkeypatch, args.out, args.steps)
    for sample in samples[::10]:
        print(sample)
    print(report(samples))
    if args.samples is not None:
        args.samples.write_text(json.dumps([dataclasses.asdict(s) for s in samples]))


if __name__ == "__main__":
    main()
