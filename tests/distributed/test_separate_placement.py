"""``rollout.schedule.placement: separate`` (1 training rank + 1 rollout rank, gloo) against the colocated loop.

With ``max_staleness`` 0 and 1 the separate run must reproduce the colocated run of the same seed
(lock-step for k = 1): the same rewards, losses and gradient norms per step (relative 1e-5) and the
same final policy. Then the rollout rank dies while generating step 2: the training rank must stop
with an error naming rollout rank 1, with step 1's metrics kept.
"""

import json
import pickle

import pytest
import torch

from nemo_sspo.cli import load_config
from nemo_sspo.megatron import destroy_parallel, export_hf_state_dict
from nemo_sspo.models import load_hf_checkpoint
from nemo_sspo.rollouts.worker import RolloutWorker
from tests.distributed._split_world import dies_at_step, fit_side, resplit
from tests.integration._loop_runs import TINY, ParityReward, make_trainer

RUN = [*TINY, "rollout.correction.name=token_tis", "optim.lr=0.05", "trainer.max_steps=3"]
KEYS = ("reward/mean", "optim/grad_norm", "loss/policy", "policy/ratio", "rollout/kl_k3_behaviour", "rollout/is_weight",
        "response/length_mean")


def _cfg(out_dir, overrides):
    return load_config(overrides=[*RUN, f"trainer.output_dir={out_dir}", *overrides])


def _separate(split, tiny, out_dir, overrides):
    cfg = _cfg(out_dir, ["rollout.schedule.placement=separate", "rollout.schedule.num_ranks=1", *overrides])
    return fit_side(cfg, split, tiny, ParityReward())


def _child(rank, world_size, out_dir):
    tiny = load_hf_checkpoint("tiny-random-llama")
    split = resplit(rank, world_size, 1, 60)
    results = {k: _separate(split, tiny, f"{out_dir}/k{k}", [f"rollout.schedule.max_staleness={k}"]) for k in (0, 1)}
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump(results, f)
    if split.is_rollout:
        RolloutWorker._generate_and_send = dies_at_step(2)
    try:
        _separate(split, tiny, f"{out_dir}/killed", [])
        message = "no error"
    except RuntimeError as err:
        message = str(err)
    with open(f"{out_dir}/killed.txt", "w") as f:
        f.write(message)


@pytest.fixture(scope="module")
def tiny():
    return load_hf_checkpoint("tiny-random-llama")


def _colocated(monkeypatch, out_dir, tiny, k):
    # One intra-op thread, as the spawned ranks run (tests/distributed/conftest.py): with 2 threads the
    # fp32 reductions split differently and the step-2 loss moved by 1.1e-5 relative, past the tolerance.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    trainer = make_trainer(monkeypatch, out_dir, ["rollout.correction.name=token_tis", "optim.lr=0.05",
                                                  "trainer.max_steps=3", f"rollout.schedule.max_staleness={k}"],
                           checkpoint=tiny)
    try:
        history = trainer.fit()
        return history, export_hf_state_dict(trainer.model.module, trainer.hf_config)
    finally:
        destroy_parallel()
        torch.set_num_threads(threads)


def test_separate_placement_equals_colocated_and_a_dead_rollout_rank_is_named(run_distributed, monkeypatch,
                                                                            tmp_path, tiny):
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 of 2 failed.*exited with code 17"):
        run_distributed(_child, 2, str(tmp_path), timeout_s=300)
    separate = pickle.loads((tmp_path / "rank0.pkl").read_bytes())
    for k in (0, 1):
        history, policy = separate[k]
        ref_history, ref_policy = _colocated(monkeypatch, tmp_path / f"colocated{k}", tiny, k)
        assert len(history) == len(ref_history) == 3
        for mine, ref in zip(history, ref_history, strict=True):
            for key in KEYS:
                assert mine[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), (k, mine["step"], key)
        if k == 1:
            assert [h["rollout/version_lag_mean"] for h in history] == [0.0, 1.0, 1.0]
        assert all(h["timing/refit_s_per_gb"] > 0 for h in history)  # the broadcast's rate, reported per step
        # CPU: no weight is on a device, so none is copied to the host (0 on GPU too, over NCCL)
        assert [h["refit/bytes_to_host"] for h in history] == [0.0] * 3
        assert [h["refit/bytes_to_host"] for h in ref_history] == [0.0] * 3  # colocated: never a host copy
        for name, tensor in ref_policy.items():
            torch.testing.assert_close(policy[name], tensor, rtol=1e-5, atol=1e-7, msg=name)
    message = (tmp_path / "killed.txt").read_text()
    assert "rollout rank 1 sent no rollout for step 2" in message
    kept = [json.loads(line) for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kept] == [1]
