"""A free-running rollout rank killed while generating (1 training rank + 2 rollout ranks, gloo): the
training rank gets step 2's first rollout from the other rank, then fails within
``rollout.schedule.peer_timeout_s`` (+ slack) of step 2's start with an error naming the killed rank (its
any-source receive sees no closed connection, so the silence names it), and step 1's metrics are kept.
"""

import json
import os
import time

import pytest

from nemo_sspo.cli import load_config
from nemo_sspo.models import load_hf_checkpoint
from nemo_sspo.rollouts import sampling
from tests.distributed._split_world import fit_side, resplit
from tests.integration._loop_runs import TINY, ParityReward, record_step_starts

PEER_TIMEOUT_S = 8
RUN = [*TINY, "trainer.max_steps=4", "rollout.schedule.placement=separate", "rollout.schedule.num_ranks=2",
       "rollout.schedule.mode=free", "rollout.schedule.max_staleness=0", f"rollout.schedule.peer_timeout_s={PEER_TIMEOUT_S}"]


def _killed_child(rank, world_size, out_dir):
    tiny = load_hf_checkpoint("tiny-random-llama")
    split = resplit(rank, world_size, 2, PEER_TIMEOUT_S)
    if rank == 2:
        inner = sampling.RolloutSampler.collect
        sampling.RolloutSampler.collect = lambda self, step: os._exit(17) if step == 2 else inner(self, step)
    starts = record_step_starts()
    try:
        cfg = load_config(overrides=[*RUN, f"trainer.output_dir={out_dir}/killed"])
        fit_side(cfg, split, tiny, ParityReward(), run=lambda trainer: trainer.fit())
        outcome = ["no error", 0.0]
    except RuntimeError as err:
        outcome = [str(err), time.monotonic() - starts.get(2, time.monotonic())]
    if rank == 0:
        with open(f"{out_dir}/killed.json", "w") as f:
            json.dump(outcome, f)


def test_a_killed_rollout_rank_is_named_within_the_peer_timeout(run_distributed, tmp_path):
    with pytest.raises(RuntimeError, match=r"(?s)rank 2 of 3 failed.*exited with code 17"):
        run_distributed(_killed_child, 3, str(tmp_path), timeout_s=240, grace_s=3 * PEER_TIMEOUT_S)
    kept = [json.loads(line) for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kept] == [1]
    message, seconds = json.loads((tmp_path / "killed.json").read_text())
    assert "rollout rank 2 sent no rollout for" in message and "no rollout rank sent rollout for step 2" in message
    assert PEER_TIMEOUT_S <= seconds < PEER_TIMEOUT_S + 4
