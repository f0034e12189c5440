"""Worker of ``test_separate_resume.py``, started by torchrun with 2 processes: 1 training rank and
1 rollout rank (``rollout.schedule.placement=separate``), split once from torchrun's rendezvous.

Runs 2 steps saving a checkpoint after step 1, then resumes a second run from it into another
output folder. Rank 0 writes both runs' step-2 metrics to ``<out>/result.json``.
Usage: ``torchrun --nproc-per-node 2 -m tests.integration._separate_resume_worker OUT``.

Imports live inside the functions: Megatron's checkpoint writer starts a spawned helper process,
which re-imports this (main) module, and should not pay for torch and Megatron again.
"""

import json
import sys
from pathlib import Path


def _run(split, overrides, checkpoint):
    from nemo_sspo.cli import load_config
    from nemo_sspo.megatron import destroy_parallel
    from nemo_sspo.trainer import loop, setup
    from tests.integration._loop_runs import TINY, ParityReward

    cfg = load_config(overrides=[*TINY, "rollout.schedule.placement=separate", "rollout.schedule.num_ranks=1", *overrides])
    if split.is_rollout:
        setup.run_rollout_rank(cfg, split, checkpoint=checkpoint, reward=ParityReward())
        return None
    trainer = loop.GRPOTrainer(cfg, setup.start_parallel(cfg.parallel, cfg.trainer.seed), checkpoint=checkpoint,
                               split=split)
    try:
        return trainer.fit()
    finally:
        destroy_parallel()


def main(out: Path) -> None:
    import datetime

    from nemo_sspo.models import load_hf_checkpoint
    from nemo_sspo.parallel.world_split import split_launched_world
    split = split_launched_world(1, timeout=datetime.timedelta(seconds=120))
    tiny = load_hf_checkpoint("tiny-random-llama")
    common = ["trainer.max_steps=2", "trainer.checkpoint_interval=1", "optim.lr=0.05"]
    straight = _run(split, [*common, f"trainer.output_dir={out / 'straight'}"], tiny)
    step1 = out / "straight" / "checkpoints" / "step_000001"
    resumed = _run(split, [*common, f"trainer.output_dir={out / 'resumed'}", f"trainer.resume={step1}"], tiny)
    if straight:  # training rank 0 logs; its history holds every step
        (out / "result.json").write_text(json.dumps({"straight": straight[-1], "resumed": resumed[-1]}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
