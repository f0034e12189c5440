"""Worker of ``test_hung_rollout_rank.py``, started by torchrun with 2 processes: 1 training rank and
1 rollout rank (``rollout.schedule.placement=separate``, free-running ``wait`` with k = 0), groups with a
timeout of ``PEER_TIMEOUT_S``.

The rollout rank's reward sleeps forever once it has scored step 1's rollout (it hangs inside
generating rollout 2, it does not die) and writes its process id to ``<out>/rollout.pid``. The
training rank records when each step started and, when fit raises, writes the error and the seconds
since step 2 started to ``<out>/failure.json``, then re-raises so torchrun ends the run.
Usage: ``torchrun --nproc-per-node 2 -m tests.integration._hung_rollout_worker OUT``.
"""

import json
import os
import sys
import time
from pathlib import Path

PEER_TIMEOUT_S = 8


class HangingReward:
    """Parity rewards for the first ``responses`` responses, then sleeps forever inside scoring."""

    def __init__(self, responses: int) -> None:
        self.left = responses

    def __call__(self, responses, answers):
        self.left -= len(responses)
        if self.left < 0:
            time.sleep(3600)
        return [float(len(r) % 2 == 0) for r in responses]

    def close(self):
        pass


def main(out: Path) -> None:
    import datetime

    from nemo_sspo.cli import load_config
    from nemo_sspo.models import load_hf_checkpoint
    from nemo_sspo.parallel.world_split import split_launched_world
    from nemo_sspo.trainer import loop, setup
    from tests.integration._loop_runs import TINY, record_step_starts

    split = split_launched_world(1, timeout=datetime.timedelta(seconds=PEER_TIMEOUT_S))
    tiny = load_hf_checkpoint("tiny-random-llama")
    cfg = load_config(overrides=[*TINY, "trainer.max_steps=3", f"trainer.output_dir={out}", "rollout.schedule.num_ranks=1",
                                 "rollout.schedule.placement=separate", "rollout.schedule.mode=free",
                                 f"rollout.schedule.peer_timeout_s={PEER_TIMEOUT_S}"])
    if split.is_rollout:
        (out / "rollout.pid").write_text(str(os.getpid()))
        per_step = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
        setup.run_rollout_rank(cfg, split, checkpoint=tiny, reward=HangingReward(per_step))
        return
    starts = record_step_starts()
    trainer = loop.GRPOTrainer(cfg, setup.start_parallel(cfg.parallel, cfg.trainer.seed), checkpoint=tiny, split=split)
    try:
        trainer.fit()
    except RuntimeError as err:
        seconds = time.monotonic() - starts[max(starts)]
        (out / "failure.json").write_text(json.dumps({"error": str(err), "step": max(starts), "seconds": seconds}))
        raise


if __name__ == "__main__":
    main(Path(sys.argv[1]))
