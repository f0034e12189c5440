"""Worker of ``test_resume_distributed.py``, started by torchrun with 2 processes, with a cosine
learning-rate schedule and warmup, so the checkpoint holds the schedule's position. Two layouts:
TP=2 (plain Adam), and DP=2 with the distributed optimizer (Adam's states sharded over the two ranks).

For each: runs 3 steps saving a checkpoint at step 2, then resumes a second trainer from that
checkpoint into another output folder and runs step 3 again, and once more with
:data:`CHANGED_SCHEDULE`. Rank 0 writes the three runs' step-3 metrics per layout to
``<out>/result.json``. Usage:
``torchrun --nproc-per-node 2 -m tests.integration._resume_worker OUT``.

Imports live inside the functions: Megatron's checkpoint writer starts a spawned helper process,
which re-imports this (main) module, and should not pay for torch and Megatron again.
"""

import json
import sys
from pathlib import Path


CHANGED_SCHEDULE = ["optim.lr=4e-5", "optim.min_lr=2e-6", "optim.lr_decay_steps=8"]
"""A resume's allowed changes of the schedule (the checkpoint's: peak 2e-5, minimum 1e-6, decay over
the run's 6 updates), which must take effect at the checkpoint's position."""

LAYOUTS = {"tp2": ["parallel.tensor_model_parallel_size=2"],
           "dp2_distributed_optimizer": ["optim.use_distributed_optimizer=true", "rollout.prompts_per_step=4"]}


def _fit(overrides, checkpoint):
    from nemo_sspo.cli import load_config
    from nemo_sspo.megatron import destroy_parallel
    from nemo_sspo.trainer import loop, setup
    from tests.integration._loop_runs import TINY

    cfg = load_config(overrides=[*TINY, *overrides])
    trainer = loop.GRPOTrainer(cfg, setup.start_parallel(cfg.parallel, cfg.trainer.seed), checkpoint=checkpoint)
    try:
        return trainer.fit()
    finally:
        destroy_parallel()


def main(out: Path) -> None:
    import torch.distributed as dist

    from nemo_sspo.models import load_hf_checkpoint
    from tests.integration._loop_runs import PARITY_REWARD

    # One process group for both trainers: torchrun's store does not support a second rendezvous
    # after destroy_process_group (initialize_parallel reuses an existing group and leaves it alone).
    dist.init_process_group("gloo")
    tiny = load_hf_checkpoint("tiny-random-llama")
    common = [f"reward.name={PARITY_REWARD}", "optim.lr_schedule=cosine", "optim.lr_warmup_steps=2",
              "optim.min_lr=1e-6", "trainer.max_steps=3", "trainer.checkpoint_interval=2"]
    results = {}
    for name, layout in LAYOUTS.items():
        run = out / name
        straight = _fit([*common, *layout, f"trainer.output_dir={run / 'straight'}"], tiny)
        step2 = run / "straight" / "checkpoints" / "step_000002"
        resumed = _fit([*common, *layout, f"trainer.output_dir={run / 'resumed'}", f"trainer.resume={step2}"], tiny)
        changed = _fit([*common, *layout, *CHANGED_SCHEDULE, f"trainer.output_dir={run / 'changed'}",
                        f"trainer.resume={step2}"], tiny)
        results[name] = {run_name: history[-1] if history else None for run_name, history
                         in (("straight", straight), ("resumed", resumed), ("changed", changed))}
    if dist.get_rank() == 0:  # rank 0 logs; its history holds every step
        (out / "result.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
