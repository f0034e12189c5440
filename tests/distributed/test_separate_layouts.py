"""``rollout.schedule.placement: separate`` with R = 2 rollout ranks under TP2 and DP2 training, against colocated.

One spawn of 4 processes runs two layouts, each first colocated on the 2 training ranks (their own
process group, the rollout ranks waiting) and then separate (``max_staleness=0``) on the split world:

- TP2 x DP1 + 2 rollout ranks: the one replica stacks the prompt groups of both rollout ranks
  (``slot_routes``: each sends one of the 2 groups) and broadcasts them over its TP group;
- DP2 + 2 rollout ranks, with DAPO dynamic sampling: rollout rank j generates replica j's groups, and
  the refill rounds all-reduce the open slots over the rollout ranks' own group, as the colocated
  generators do over data-parallel.

Separate must give the colocated run's rollouts (response ids and rewards per step, each training
rank's), losses, gradient norms and sampling metrics (relative 1e-5) and the same final policy, and
every rollout rank must end cleanly. Then, in the DP2 layout, rollout rank 2 (not the world's last
rank) dies while generating step 2: replica 0, which takes its groups from it, must stop with an error
naming rank 2, with step 1's metrics kept.
"""

import json
import os
import pickle

import pytest
import torch
import torch.distributed as dist

from nemo_sspo.cli import load_config
from nemo_sspo.megatron import destroy_parallel, export_hf_state_dict
from nemo_sspo.models import load_hf_checkpoint
from nemo_sspo.trainer import loop, setup
from nemo_sspo.trainer.policy import Policy
from nemo_sspo.rollouts.worker import RolloutWorker
from tests.distributed._split_world import dies_at_step, fit_side, resplit
from tests.integration._loop_runs import TINY, ParityReward

RUN = [*TINY, "rollout.correction.name=token_tis", "optim.lr=0.05"]
LAYOUTS = {
    "tp2": ["parallel.tensor_model_parallel_size=2"],
    "dp2_dynamic": ["parallel.micro_batch_size=1", "rollout.sampling.dynamic_sampling=true", "rollout.sampling.max_sampling_rounds=3"],
}
ROLLOUT_RANKS, TRAINING_RANKS = 2, 2
KEYS = ("reward/mean", "optim/grad_norm", "loss/policy", "policy/ratio", "rollout/kl_k3_behaviour", "rollout/is_weight",
        "response/length_mean", "rollout/kept_group_frac", "rollout/sampling_rounds")

_SEEN = []  # (step's response ids, rewards) of every prepare_batch call of this process


def _record_rollouts():
    inner = Policy.prepare_batch

    def recorded(self, rollout, *args):
        _SEEN.append((rollout.batch.response_ids.clone(), rollout.rewards.clone()))
        return inner(self, rollout, *args)

    Policy.prepare_batch = recorded


def _fit(cfg, tiny, split=None):
    def recorded(trainer):
        _SEEN.clear()
        history = trainer.fit()
        policy = export_hf_state_dict(trainer.model.module, trainer.hf_config)
        return {"history": history, "policy": policy, "rollouts": list(_SEEN)}

    if split is None:  # colocated: this side's world is the training ranks
        trainer = loop.GRPOTrainer(cfg, setup.start_parallel(cfg.parallel, cfg.trainer.seed), checkpoint=tiny,
                                   reward=ParityReward())
        try:
            return recorded(trainer)
        finally:
            destroy_parallel()
    return fit_side(cfg, split, tiny, ParityReward(), run=recorded)


def _killed(rank, world_size, store, out_dir, tiny):
    """The DP2 layout, separate, with rollout rank 2 dying in step 2; training rank 0 writes its error."""
    split = resplit(rank, world_size, ROLLOUT_RANKS, 60, prefix="killed", store=store)
    cfg = load_config(overrides=[*RUN, *LAYOUTS["dp2_dynamic"], f"trainer.output_dir={out_dir}/killed",
                                 "rollout.schedule.placement=separate", f"rollout.schedule.num_ranks={ROLLOUT_RANKS}"])
    if rank == 2:
        RolloutWorker._generate_and_send = dies_at_step(2)
    try:  # the survivors fail too (their peers are gone); only rank 2's exit is the run's failure
        _fit(cfg, tiny, split)
        message = "no error"
    except RuntimeError as err:
        message = str(err)
    if rank == 0:
        with open(f"{out_dir}/killed.txt", "w") as f:
            f.write(message)


def _layout(rank, world_size, store, out_dir, name, tiny):
    overrides = [*RUN, *LAYOUTS[name]]
    result = {}
    dist.destroy_process_group()  # the launch's (first layout) or the last split's side group
    if rank < TRAINING_RANKS:  # colocated on the training ranks alone (load_config reads WORLD_SIZE)
        os.environ["WORLD_SIZE"] = str(TRAINING_RANKS)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"{name}/colocated", store), rank=rank,
                                world_size=TRAINING_RANKS)
        try:
            result["colocated"] = _fit(load_config(overrides=[*overrides, f"trainer.output_dir={out_dir}/{name}c"]),
                                       tiny)
        finally:
            dist.destroy_process_group()
            os.environ["WORLD_SIZE"] = str(world_size)
    # The rollout ranks wait here while the training ranks run the colocated reference.
    split = resplit(rank, world_size, ROLLOUT_RANKS, 240, prefix=name, store=store)
    cfg = load_config(overrides=[*overrides, f"trainer.output_dir={out_dir}/{name}s", "rollout.schedule.placement=separate",
                                 f"rollout.schedule.num_ranks={ROLLOUT_RANKS}"])
    separate = _fit(cfg, tiny, split)
    if separate is not None:
        result["separate"] = separate
    return result


def _child(rank, world_size, out_dir):
    torch.set_num_threads(1)
    tiny = load_hf_checkpoint("tiny-random-llama")
    store = dist.distributed_c10d._get_default_store()
    _record_rollouts()
    results = {name: _layout(rank, world_size, store, out_dir, name, tiny) for name in LAYOUTS}
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump(results, f)
    _killed(rank, world_size, store, out_dir, tiny)


def test_separate_with_two_rollout_ranks_equals_colocated_and_a_dead_one_is_named(run_distributed, tmp_path):
    with pytest.raises(RuntimeError, match=r"(?s)rank 2 of 4 failed.*exited with code 17"):
        run_distributed(_child, TRAINING_RANKS + ROLLOUT_RANKS, str(tmp_path), timeout_s=400)
    ranks = [pickle.loads((tmp_path / f"rank{rank}.pkl").read_bytes()) for rank in range(4)]
    assert all(ranks[r][name] == {} for r in (2, 3) for name in LAYOUTS)  # rollout ranks ended cleanly
    for name in LAYOUTS:
        for rank in range(TRAINING_RANKS):
            colocated, separate = ranks[rank][name]["colocated"], ranks[rank][name]["separate"]
            assert len(colocated["rollouts"]) == len(separate["rollouts"]) == 2
            for step, ((ids, rewards), (ref_ids, ref_rewards)) in enumerate(
                    zip(separate["rollouts"], colocated["rollouts"], strict=True), 1):
                assert torch.equal(ids, ref_ids), (name, rank, step)
                assert torch.equal(rewards, ref_rewards), (name, rank, step)
        history, ref_history = ranks[0][name]["separate"]["history"], ranks[0][name]["colocated"]["history"]
        assert len(history) == len(ref_history) == 2
        for mine, ref in zip(history, ref_history, strict=True):
            for key in KEYS:
                assert mine[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), (name, mine["step"], key)
        for tensor_name, tensor in ranks[0][name]["colocated"]["policy"].items():
            torch.testing.assert_close(ranks[0][name]["separate"]["policy"][tensor_name], tensor, rtol=1e-5, atol=1e-7,
                                       msg=f"{name}: {tensor_name}")
    # Dynamic sampling refilled some zero-variance groups (otherwise the rollout ranks' collective went unused).
    assert any(h["rollout/sampling_rounds"] > 1 for h in ranks[0]["dp2_dynamic"]["separate"]["history"])
    assert "rollout rank 2 sent no rollout for step 2" in (tmp_path / "killed.txt").read_text()
    kept = [json.loads(line) for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kept] == [1]
