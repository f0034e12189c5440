"""DCPO's smooth advantage standardisation in the loop (``loss=dcpo advantage.name=dcpo_smooth``).

A pool of 2 problems and 2 prompt groups per step visits each problem once per step, so step s is
visit s of both. The per-prompt history must (a) survive a checkpoint: a run resumed from step 2
computes step 3 exactly as the uninterrupted run (history restored from trainer_state.json), and
(b) be the same on every data-parallel rank and equal to one process's: each of 2 gloo ranks rolls out
one of the two groups, yet both keep both prompts' stats.
"""

import json

import pytest
import torch

from nemo_sspo.algorithms import smooth_group_advantages
from nemo_sspo.megatron import destroy_parallel
from nemo_sspo.models import load_hf_checkpoint
from nemo_sspo.trainer.checkpoint import STATE_FILE
from tests.integration._loop_runs import generate, make_trainer, observe, run

SMOOTH = ["loss=dcpo", "advantage.name=dcpo_smooth", "data.options.pool_size=2"]


def _record_advantages(store):
    """Appends ``(rewards, keys, advantages, history after the step)`` for every step."""
    def capture(trainer):
        def record(data):
            versioned, advantages = data
            store.append((versioned.rollout.rewards.clone(), list(versioned.rollout.prompt_keys), advantages.clone(),
                          dict(trainer.advantages.history)))

        observe(trainer, "advantages", record)

    return capture


def _without_timings(record):
    return {k: v for k, v in record.items() if not k.startswith(("timing/", "throughput/"))}  # wall-clock based


def test_history_is_checkpointed_and_a_resumed_run_equals_the_uninterrupted_one(monkeypatch, tmp_path):
    tiny = load_hf_checkpoint("tiny-random-llama")
    overrides = [*SMOOTH, "trainer.max_steps=3", "trainer.checkpoint_interval=2"]
    straight_steps, resumed_steps = [], []
    straight = run(monkeypatch, tmp_path / "run", overrides, checkpoint=tiny,
                   capture=_record_advantages(straight_steps))
    keys = sorted(straight_steps[0][1])
    assert len(keys) == 2 and all(sorted(step[1]) == keys for step in straight_steps)  # both problems, every step
    assert [{k: st.visits for k, st in step[3].items()} for step in straight_steps] == [
        dict.fromkeys(keys, 1), dict.fromkeys(keys, 2), dict.fromkeys(keys, 3)]
    # Visit 3 reads the history: the advantages differ from a first visit's (the GRPO z-score).
    rewards, step_keys, advantages, _ = straight_steps[2]
    first_visit, _ = smooth_group_advantages(rewards, 2, step_keys, {})
    assert not torch.equal(advantages, first_visit)
    saved = json.loads((tmp_path / "run" / "checkpoints" / "step_000002" / STATE_FILE).read_text())
    assert saved["advantage_history"] == {k: [st.visits, st.mean, st.std] for k, st in straight_steps[1][3].items()}

    resumed = run(monkeypatch, tmp_path / "resumed", [
        *overrides, f"trainer.resume={tmp_path / 'run' / 'checkpoints' / 'step_000002'}"],
        checkpoint=tiny, capture=_record_advantages(resumed_steps))
    (resumed_step,) = resumed_steps
    assert torch.equal(resumed_step[2], straight_steps[2][2])
    assert resumed_step[3] == straight_steps[2][3]
    assert _without_timings(resumed[-1]) == _without_timings(straight[-1])


def _two_rollouts(rank, world_size, tmp_dir):
    """Steps 1 and 2 rolled out and given advantages, without updates, in a spawned gloo process (or
    this one, for world size 1); the rollouts stay those of the initial weights for any data-parallel size."""
    monkeypatch = pytest.MonkeyPatch()
    trainer = make_trainer(monkeypatch, f"{tmp_dir}/w{world_size}", [*SMOOTH, "trainer.minibatches_per_step=1"])
    try:
        advantages = [trainer.compute_advantages(generate(trainer, step))[0].tolist() for step in (1, 2)]
        return advantages, {k: (st.visits, st.mean, st.std) for k, st in trainer.advantages.history.items()}
    finally:
        trainer.close()
        destroy_parallel()


@pytest.mark.slow
def test_history_is_identical_on_every_data_parallel_rank(run_distributed, tmp_path):
    single_adv, single_history = _two_rollouts(0, 1, str(tmp_path))  # one process: this one
    split = run_distributed(_two_rollouts, 2, str(tmp_path))
    assert len(single_history) == 2 and {v[0] for v in single_history.values()} == {2}
    for _, history in split:
        assert history == single_history
    for step in range(2):  # rank 0 holds the first group's rows, rank 1 the second's
        assert split[0][0][step] + split[1][0][step] == single_adv[step]
