"""Worker of ``test_free_running_ranks.py``, started by torchrun with 3 processes: 1 training rank and
2 free-running rollout ranks, split once from torchrun's rendezvous.

Runs, in turn: ``wait`` with k = 0 for 4 steps with checkpoints at 2 and 4; the same resumed from
its step-2 checkpoint; ``drop`` with k = 0 and a slow trainer (0.5 s per update); partial rollouts
(``wait``, k = 1, 3 steps) with a slow engine (``DECODE_DELAY_S`` per decode step, so a 1-group rollout of 8
tokens takes ~1.2 s while a training step takes less): a rank's second rollout is still generating
when the trainer posts version 1, and continues with it. The training rank records, for every
rollout it receives (a wrapper around ``recv_free_rollout``), its rank, number and version and each
response's oldest and newest token version, and writes each run's history and receipts to
``<out>/result.json``.
Usage: ``torchrun --nproc-per-node 3 -m tests.integration._free_ranks_worker OUT``.

Imports live inside the functions: Megatron's checkpoint writer starts a spawned helper process,
which re-imports this (main) module, and should not pay for torch and Megatron again.
"""

import json
import sys
from pathlib import Path

RUN = ["trainer.max_steps=4", "trainer.minibatches_per_step=1", "rollout.correction.name=token_tis", "optim.lr=0.05",
       "rollout.schedule.placement=separate", "rollout.schedule.num_ranks=2", "rollout.schedule.mode=free", "rollout.schedule.max_staleness=0"]
UPDATE_DELAY_S = 0.5
DECODE_DELAY_S = 0.15


def _run(split, tiny, overrides):
    import torch

    from nemo_sspo.cli import load_config
    from nemo_sspo.rollouts import collector
    from tests.distributed._split_world import fit_side
    from tests.integration._loop_runs import TINY, ParityReward

    cfg = load_config(overrides=[*TINY, *RUN, *overrides])
    received, inner = [], collector.recv_free_rollout

    def recv(*, group, sources, src=None, what):
        got = inner(group=group, sources=sources, src=src, what=what)
        rb = got[2].rollout.batch
        newest = [] if rb.token_versions is None else torch.where(rb.response_mask, rb.token_versions, -1).amax(1).tolist()
        received.append((got[0], got[1], got[2].version, got[2].versions().tolist(), newest))
        return got
    collector.recv_free_rollout = recv
    try:
        history = fit_side(cfg, split, tiny, ParityReward(), run=lambda trainer: trainer.fit())
    finally:
        collector.recv_free_rollout = inner
    return None if history is None else {"history": history, "received": received}


def _slow_decoding() -> None:
    """Every decode step of a partial generation takes ``DECODE_DELAY_S`` longer."""
    import time

    from nemo_sspo.rollout import HFRolloutEngine

    inner = HFRolloutEngine.generate_partial

    def slow(self, prompts, prefixes, *, seed, interrupt=None):
        def paced():
            time.sleep(DECODE_DELAY_S)
            return interrupt()
        return inner(self, prompts, prefixes, seed=seed, interrupt=paced)
    HFRolloutEngine.generate_partial = slow


def main(out: Path) -> None:
    import datetime
    import time

    from nemo_sspo.models import load_hf_checkpoint
    from nemo_sspo.parallel.world_split import split_launched_world
    from nemo_sspo.trainer.policy import Policy

    split = split_launched_world(2, timeout=datetime.timedelta(seconds=120))
    tiny = load_hf_checkpoint("tiny-random-llama")
    wait = ["rollout.schedule.stale_policy=wait", "trainer.checkpoint_interval=2"]
    results = {"full": _run(split, tiny, [*wait, f"trainer.output_dir={out / 'full'}"])}
    step2 = out / "full" / "checkpoints" / "step_000002"
    results["resumed"] = _run(split, tiny, [*wait, f"trainer.output_dir={out / 'resumed'}", f"trainer.resume={step2}"])
    inner = Policy.update
    Policy.update = lambda self, batch: (time.sleep(UPDATE_DELAY_S), inner(self, batch))[1]
    results["drop"] = _run(split, tiny, ["rollout.schedule.stale_policy=drop", f"trainer.output_dir={out / 'drop'}"])
    Policy.update = inner
    _slow_decoding()
    results["partial"] = _run(split, tiny, ["rollout.schedule.partial=true", "rollout.schedule.max_staleness=1", "trainer.max_steps=3",
                                            f"trainer.output_dir={out / 'partial'}"])
    if split.rank == 0:
        (out / "result.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
