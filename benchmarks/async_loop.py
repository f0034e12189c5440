"""Benchmark: the synchronous colocated loop against separate rollout / training ranks (CPU, gloo).

    python benchmarks/async_loop.py [--steps 5] [--out /tmp/async_loop]

Runs of the default CPU task (``sspo_smollm2_cpu``: SmolLM2-135M, word problems, the same
seed, so the same prompts), each with 2 cores in all:

- ``a``: colocated, one process with 2 threads (generation and training take turns);
- ``b``: ``rollout.schedule.placement=separate``, ``max_staleness=0``: 1 training + 1 rollout process,
  1 thread each (the sides still take turns: each waits for the other);
- ``c``: the same with ``max_staleness=1`` (the rollout rank generates step t + 1 while step t trains);
- ``d``: ``max_staleness=2``;
- ``e``: free-running (``rollout.schedule.mode=free``) with ``max_staleness=1``, ``stale_policy=wait``;
- ``f``: free-running with ``max_staleness=1``, ``stale_policy=drop`` (dropped rollouts count as rollout
  busy time; the table's ``dropped`` column is the share of received rollouts dropped);
- ``g``: free-running over two rollout ranks (1 training + 2 rollout processes, 1 thread each, on the
  2 cores), ``max_staleness=2``, ``stale_policy=wait``, on a generation-bound setting (:data:`_GEN_BOUND`);
- ``h``: lock-step over the same two rollout ranks and setting, ``max_staleness=2``.

``--variants`` runs a subset (the summary line needs ``a`` and ``c``; the free-running line ``g``
and ``h``).

Per run, over the wall window from the end of step 1 (which fills the pipeline and pays start-up
costs) to the end of step S, from the training rank's ``timeline.jsonl`` and ``metrics.jsonl``:
time per step, response tokens per second, each side's busy share of the window (rollout:
generating and scoring; training: train + refit) and its idle share, the mean version lag and the
mean reward of the last two steps. Each run draws ``timeline.png`` beside ``reward_entropy.png``. The last line
is ``bottleneck_busy=<c: busy time of the slower side / wall time> async_vs_sync=<a / c time per step>``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

_COMMON = ["trainer.save_hf_checkpoint=false", "trainer.overwrite_output_dir=true", "rollout.correction.name=token_tis"]
_GEN_BOUND = ["model=tiny_random", "data.template=qwen-math", "rollout.sampling.max_new_tokens=256",
              "trainer.minibatches_per_step=1"]
"""The tiny random Llama with 256-token responses (it never samples a stop id) and one update per step:
token-by-token generation outweighs the update (the summary line prints the share it ran at). It
measures the schedule, not learning."""
_VARIANTS = {
    "a": (1, 2, []),
    "b": (2, 1, ["rollout.schedule.placement=separate", "rollout.schedule.num_ranks=1", "rollout.schedule.max_staleness=0"]),
    "c": (2, 1, ["rollout.schedule.placement=separate", "rollout.schedule.num_ranks=1", "rollout.schedule.max_staleness=1"]),
    "d": (2, 1, ["rollout.schedule.placement=separate", "rollout.schedule.num_ranks=1", "rollout.schedule.max_staleness=2"]),
    "e": (2, 1, ["rollout.schedule.placement=separate", "rollout.schedule.num_ranks=1", "rollout.schedule.max_staleness=1",
                 "rollout.schedule.mode=free", "rollout.schedule.stale_policy=wait"]),
    "f": (2, 1, ["rollout.schedule.placement=separate", "rollout.schedule.num_ranks=1", "rollout.schedule.max_staleness=1",
                 "rollout.schedule.mode=free", "rollout.schedule.stale_policy=drop"]),
    "g": (3, 1, ["rollout.schedule.placement=separate", "rollout.schedule.num_ranks=2", "rollout.schedule.max_staleness=2",
                 "rollout.schedule.mode=free", "rollout.schedule.stale_policy=wait", *_GEN_BOUND]),
    "h": (3, 1, ["rollout.schedule.placement=separate", "rollout.schedule.num_ranks=2", "rollout.schedule.max_staleness=2", *_GEN_BOUND]),
}


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(name: str, steps: int, out: Path) -> tuple[list[dict], list[dict]]:
    processes, threads, overrides = _VARIANTS[name]
    folder = out / name
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1")
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={processes}"]
    command = [*launcher, "-m", "nemo_sspo.cli", "train", f"trainer.max_steps={steps}",
               f"trainer.output_dir={folder}", *_COMMON, *overrides]
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    return _records(folder / "metrics.jsonl"), _records(folder / "timeline.jsonl")


def _busy(events: list[dict], phases: tuple[str, ...], start: float, end: float) -> float:
    """Seconds of ``phases`` windows inside [start, end]."""
    return sum(max(0.0, min(e["end"], end) - max(e["start"], start)) for e in events if e["phase"] in phases)


def _summary(name: str, history: list[dict], events: list[dict], responses_per_step: int) -> dict:
    steady = history[1:]
    trainer = [e for e in events if e["lane"] == "training ranks"]
    start = max(e["end"] for e in trainer if e["step"] == 1)
    end = max(e["end"] for e in trainer)
    wall = end - start
    tokens = sum(h["response/length_mean"] * responses_per_step for h in steady)
    rollout_ranks = max(1, _VARIANTS[name][0] - 1)  # separate: every process but the training one
    generation = [e["end"] - e["start"] for e in events if e["lane"] != "training ranks" and e["phase"] == "generation"
                  and e["step"] > 1]
    return {
        "variant": name, "step_s": wall / len(steady), "tokens_per_s": tokens / wall,
        "rollout_busy": _busy(events, ("generation", "dropped"), start, end) / (wall * rollout_ranks),
        "generation_s": sum(generation) / max(1, len(generation)),  # one rollout's generation window
        "train_s": sum(h["timing/train_s"] + h.get("timing/refit_s", 0.0) for h in steady) / len(steady),
        "train_busy": _busy(trainer, ("train", "refit", "critic"), start, end) / wall,
        "lag": sum(h.get("rollout/version_lag_mean", 0.0) for h in steady) / len(steady),
        "reward": sum(h["reward/mean"] for h in history[-2:]) / 2,
        "dropped": sum(h.get("rollout/dropped_share", 0.0) for h in steady) / len(steady),
    }


def main() -> None:
    """Runs the variants and prints their table and the summary line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="steps per run (>= 3)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/async_loop"))
    parser.add_argument("--variants", default="".join(_VARIANTS), help="letters of the variants to run")
    args = parser.parse_args()
    unknown = set(args.variants) - set(_VARIANTS)
    if unknown:
        parser.error(f"--variants: unknown {''.join(sorted(unknown))}; valid: {''.join(_VARIANTS)}")
    if args.steps < 3:
        parser.error("--steps must be >= 3 (step 1 is excluded, the reward averages the last two)")
    responses = 2 * 8  # the default rollout.prompts_per_step x rollout.samples_per_prompt
    rows = {name: _summary(name, *_run(name, args.steps, args.out), responses)
            for name in _VARIANTS if name in args.variants}
    print(f"{'variant':<8}{'s/step':>8}{'tok/s':>8}{'gen busy':>10}{'gen idle':>10}{'train busy':>12}"
          f"{'train idle':>12}{'lag':>6}{'reward':>8}{'dropped':>9}")
    for r in rows.values():
        print(f"{r['variant']:<8}{r['step_s']:>8.2f}{r['tokens_per_s']:>8.1f}{r['rollout_busy']:>10.2f}"
              f"{1 - r['rollout_busy']:>10.2f}{r['train_busy']:>12.2f}{1 - r['train_busy']:>12.2f}{r['lag']:>6.2f}"
              f"{r['reward']:>8.3f}{r['dropped']:>9.2f}")
    print(f"timelines: {args.out}/<variant>/timeline.png")
    if "a" in rows and "c" in rows:
        a, c = rows["a"], rows["c"]
        print(f"bottleneck_busy={max(c['rollout_busy'], c['train_busy']):.3f} "
              f"async_vs_sync={a['step_s'] / c['step_s']:.3f}")
    if "g" in rows and "h" in rows:
        g, h = rows["g"], rows["h"]
        # a step of R = 2 rollout ranks generates one rollout on each (in parallel), then trains
        share = g["generation_s"] / (g["generation_s"] + g["train_s"])
        projected = (g["generation_s"] + g["train_s"]) / max(g["generation_s"], g["train_s"])
        print(f"free_running_R2: bottleneck_busy={max(g['rollout_busy'], g['train_busy']):.3f} "
              f"free_vs_lockstep={h['step_s'] / g['step_s']:.3f} generation_share={share:.2f} "
              f"projected_free_vs_sync_on_own_gpus={projected:.2f} (a projection from the measured phase times: "
              f"each side on its own GPUs, no shared cores)")


if __name__ == "__main__":
    main()
