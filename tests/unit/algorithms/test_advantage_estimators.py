"""The advantage-estimator seam (``advantage.name``): hand values of every built-in, the float64
references of ``tests/unit/advantage_reference.py``, scopes, the registry and the load-time refusals."""

import math
import random

import pytest
import torch

from nemo_sspo.algorithms.advantage_estimators import (
    AdvantageEstimator,
    AdvantageInputs,
    advantage_estimator_names,
    estimate_advantages,
    get_advantage_estimator,
    register_advantage_estimator,
    scope_index,
    unregister_advantage_estimator,
)
from nemo_sspo.cli import load_config
from tests.unit.advantage_reference import reference_advantages

R = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]  # two groups of G = 4


def _estimate(name, rewards, samples_per_prompt, *, minibatches=1, task_rewards=None, normalize_std=True,
              value_logits=None):
    rewards = torch.tensor(rewards, dtype=torch.float64)
    task = rewards if task_rewards is None else torch.tensor(task_rewards, dtype=torch.float64)
    logits = None if value_logits is None else torch.tensor(value_logits, dtype=torch.float64)
    return estimate_advantages(get_advantage_estimator(name),
                               AdvantageInputs(rewards, task, samples_per_prompt, normalize_std=normalize_std,
                                               value_logits=logits), minibatches=minibatches)


def test_builtins_are_registered():
    assert {"group", "leave_one_out", "batch_std", "critic"} <= set(advantage_estimator_names())
    scopes = {n: get_advantage_estimator(n).scope for n in ("group", "leave_one_out", "batch_std", "critic")}
    assert scopes == {"group": "group", "leave_one_out": "group", "batch_std": "optimizer_batch", "critic": "group"}


def test_hand_values_of_every_builtin():
    # group: [1,0,0,0] mean 1/4, pstdev sqrt(3)/4 -> sqrt(3), -1/sqrt(3); [1,1,0,0] mean 1/2, std 1/2 -> +-1.
    r3 = math.sqrt(3.0)
    torch.testing.assert_close(_estimate("group", R, 4), torch.tensor([r3, -1 / r3, -1 / r3, -1 / r3,
                                                                       1.0, 1.0, -1.0, -1.0]), rtol=1e-5, atol=0)
    # leave_one_out: r_i - (sum - r_i) / 3. Group 1: 1 - 0 = 1, 0 - 1/3. Group 2: 1 - 1/3 = 2/3, 0 - 2/3.
    torch.testing.assert_close(_estimate("leave_one_out", R, 4),
                               torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3, 2 / 3, 2 / 3, -2 / 3, -2 / 3]))
    # batch_std: centred [.75, -.25, -.25, -.25, .5, .5, -.5, -.5]; squares sum 0.75 + 1.0 = 1.75, mean 0 ->
    # std = sqrt(1.75 / 8) = 0.467707; A = centred / 0.467707 = 1.603567, -0.534522, 1.069045, -1.069045.
    s = math.sqrt(1.75 / 8)
    torch.testing.assert_close(_estimate("batch_std", R, 4),
                               torch.tensor([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]) / (s + 1e-6))
    # batch_std with two optimizer batches (rows 0-3 and 4-7): each group is its own batch.
    # Group 1: std sqrt(0.75 / 4) = 0.433013 -> 0.75 / 0.433013 = sqrt(3); group 2: std 0.5 -> +-1 (as group).
    torch.testing.assert_close(_estimate("batch_std", R, 4, minibatches=2), _estimate("group", R, 4))
    # critic: r - sigmoid(V); V = 0 -> 0.5, V = ln 3 -> 0.75.
    torch.testing.assert_close(_estimate("critic", R, 4, value_logits=[0.0, math.log(3.0)]),
                               torch.tensor([0.5, -0.5, -0.5, -0.5, 0.25, 0.25, -0.75, -0.75]))


def test_equal_task_reward_groups_get_zero_except_with_the_critic():
    # Shaped rewards differ in group 1 but its task rewards are all 0: advantage 0 (DAPO's rule).
    shaped, task = [0.0, -0.5, 0.0, -0.25, 1.0, 1.0, 0.0, 0.0], [0.0] * 4 + [1.0, 1.0, 0.0, 0.0]
    for name in ("group", "leave_one_out", "batch_std"):
        adv = _estimate(name, shaped, 4, task_rewards=task)
        assert adv[:4].tolist() == [0.0] * 4, name
        assert torch.all(adv[4:] != 0), name
    # The critic keeps r - sigmoid(0) = r - 0.5 for that group.
    assert _estimate("critic", shaped, 4, task_rewards=task, value_logits=[0.0, 0.0])[:4].tolist() == [
        -0.5, -1.0, -0.5, -0.75]


@pytest.mark.parametrize("name", ["group", "leave_one_out", "batch_std", "critic"])
@pytest.mark.parametrize("minibatches", [1, 2, 4])
def test_every_builtin_equals_the_float64_reference(name, minibatches):
    rng = random.Random(7)
    group, prompts = 4, 8
    task = [float(rng.random() < 0.5) for _ in range(group * prompts)]
    task[:group] = [1.0] * group  # one all-correct group
    rewards = [t - 0.3 * rng.random() for t in task]  # shaped
    logits = [rng.uniform(-2, 2) for _ in range(prompts)]
    got = _estimate(name, rewards, group, minibatches=minibatches, task_rewards=task, value_logits=logits)
    want = reference_advantages(name, rewards, group, minibatches=minibatches, task_rewards=task,
                                value_logits=logits)
    # float32 results of float64 maths: relative 1e-6 of values of order 1.
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32), rtol=1e-6, atol=1e-6)


def test_group_without_std_is_dr_grpo():
    # Dr. GRPO: r - mean_g: means 1/4 and 1/2.
    assert _estimate("group", R, 4, normalize_std=False).tolist() == [0.75, -0.25, -0.25, -0.25,
                                                                      0.5, 0.5, -0.5, -0.5]


def test_scope_index():
    assert scope_index(8, 2, "group")[0].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert scope_index(8, 2, "optimizer_batch", 2)[0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert scope_index(8, 2, "step", 4)[0].tolist() == [0] * 8
    with pytest.raises(ValueError, match="minibatches=3"):
        scope_index(8, 2, "step", 3)


def test_step_scope_sums_go_through_reduce():
    # A step-scope estimator returning its scope's count and mean reward: with a reduce that adds another
    # rank's table (4 rows, rewards summing to 3), count = 8 and mean = (2 + 3) / 8.
    est = AdvantageEstimator("t_step", "step", lambda inputs, stats: stats.means[:, 0] + stats.count,
                             row_values=lambda inputs: inputs.rewards.double().unsqueeze(1))
    other = torch.tensor([[4.0, 3.0]], dtype=torch.float64)
    adv = estimate_advantages(est, AdvantageInputs(torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([1.0, 0.0, 1.0, 0.0]),
                                                   2), reduce=lambda table: table + other)
    assert adv.tolist() == [8 + 5 / 8] * 4


def test_registry_refusals():
    est = AdvantageEstimator("t_tmp", "group", lambda inputs, stats: inputs.rewards)
    register_advantage_estimator(est)
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator(est)
    finally:
        unregister_advantage_estimator("t_tmp")
    with pytest.raises(ValueError, match="scope='batch'"):
        register_advantage_estimator(AdvantageEstimator("t_bad", "batch", lambda inputs, stats: inputs.rewards))
    with pytest.raises(ValueError, match="std='sometimes'"):
        register_advantage_estimator(AdvantageEstimator("t_bad", "group", lambda i, s: i.rewards, std="sometimes"))
    with pytest.raises(ValueError, match="name='nope' is not a registered advantage estimator.*leave_one_out"):
        get_advantage_estimator("nope")


def test_estimate_refusals():
    with pytest.raises(ValueError, match="needs samples_per_prompt >= 2"):
        _estimate("leave_one_out", [1.0, 0.0], 1)
    with pytest.raises(ValueError, match="pass value_logits"):
        _estimate("critic", R, 4)
    with pytest.raises(ValueError, match="returned shape"):
        estimate_advantages(AdvantageEstimator("t", "group", lambda i, s: i.rewards[:1]),
                            AdvantageInputs(torch.zeros(4), torch.zeros(4), 2))


# ---- config: advantage.name against the loss ----------------------------------------------------

def test_advantage_name_resolves_from_the_loss():
    assert load_config(overrides=["loss=grpo"]).advantage.name == "group"
    assert load_config(overrides=["loss=sppo", "rollout.samples_per_prompt=1",
                                  "rollout.prompts_per_step=8"]).advantage.name == "critic"
    assert load_config(overrides=["loss=grpo", "advantage.name=leave_one_out"]).advantage.name == "leave_one_out"
    assert load_config(overrides=["loss=sppo", "advantage.name=critic"]).advantage.name == "critic"


@pytest.mark.parametrize("overrides, fragment", [
    (["advantage.name=nope"], r"advantage.name='nope' is not a registered advantage estimator"),
    (["loss=sppo", "advantage.name=group"], r"advantage.name='group' with loss=sppo.*set advantage.name=critic"),
    (["loss=grpo", "advantage.name=critic"], r"advantage.name='critic' trains a critic, but loss=grpo"),
    (["loss=dr_grpo", "advantage.name=batch_std"],
     r"advantage.name='batch_std' divides by a standard deviation, but advantage.normalize_std=false "
     r"\(loss=dr_grpo's default\) asks for none"),
    (["loss=grpo", "advantage.name=batch_std", "advantage.normalize_std=false"],
     r"but advantage.normalize_std=false asks for none; set advantage.name=group"),
    (["advantage.name=leave_one_out", "advantage.normalize_std=true"],
     r"advantage.normalize_std=True is not read by advantage.name='leave_one_out'"),
    (["loss=dcpo", "advantage.name=dcpo_smooth", "rollout.sampling.dynamic_sampling=true"],
     r"rollout.sampling.dynamic_sampling=true .* advantage.name='dcpo_smooth'"),
    (["loss=sppo", "rollout.sampling.dynamic_sampling=true"], r"rollout.sampling.dynamic_sampling=true .* advantage.name='critic'"),
    (["advantage.name=leave_one_out", "rollout.samples_per_prompt=1", "rollout.prompts_per_step=8"],
     r"rollout.samples_per_prompt=1 is below the 2 .* advantage.name='leave_one_out'"),
])
def test_contradictions_are_refused_at_load(overrides, fragment):
    with pytest.raises(ValueError, match=fragment):
        load_config(overrides=overrides)


# ---- per-prompt history: DCPO's smooth standardisation through the seam ------------------------------

def test_dcpo_smooth_estimator_equals_smooth_group_advantages_on_each_rank_of_a_split_step():
    from nemo_sspo.algorithms.advantage_estimators import DCPO_SMOOTH, estimate_advantages_and_history
    from nemo_sspo.algorithms.advantages import PromptRewardStats, smooth_group_advantages

    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0])
    keys = ["p", "q", "p", "r"]  # "p" visited twice in the step: its second group sees the first's stats
    history = {"q": PromptRewardStats(1, 0.5, math.sqrt(1 / 3))}
    want, want_history = smooth_group_advantages(rewards, 4, keys, history)  # hand-checked in test_advantages.py
    halves = [AdvantageInputs(rewards[:8], rewards[:8], 4, prompt_keys=keys[:2], history=history),
              AdvantageInputs(rewards[8:], rewards[8:], 4, prompt_keys=keys[2:], history=history)]
    parts = [(list(h.prompt_keys), DCPO_SMOOTH.group_values(h)) for h in halves]  # what the gather collects
    got = [estimate_advantages_and_history(DCPO_SMOOTH, half, gather=lambda obj, r=r: (parts, r))
           for r, half in enumerate(halves)]
    assert torch.equal(torch.cat([got[0][0], got[1][0]]), want)
    assert got[0][1] == got[1][1] == want_history and want_history["p"].visits == 2
    assert history == {"q": PromptRewardStats(1, 0.5, math.sqrt(1 / 3))}  # the caller's history is not modified
    # A group with all-equal rewards keeps a signal from its history (q: visit 2 of [1, 1, 1, 1]).
    assert torch.all(want[4:8] != 0)


def test_history_estimators_are_refused_where_they_cannot_work():
    from nemo_sspo.algorithms.advantage_estimators import DCPO_SMOOTH

    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="estimate_advantages_and_history"):
        estimate_advantages(DCPO_SMOOTH, AdvantageInputs(rewards, rewards, 2, prompt_keys=["a", "b"]))
    from nemo_sspo.algorithms.advantage_estimators import estimate_advantages_and_history
    with pytest.raises(ValueError, match="pass prompt_keys, one per group"):
        estimate_advantages_and_history(DCPO_SMOOTH, AdvantageInputs(rewards, rewards, 2, prompt_keys=["a"]))
    with pytest.raises(ValueError, match="group_values needs scope='step'"):
        register_advantage_estimator(AdvantageEstimator("t_bad", "group", lambda i, s: i.rewards,
                                                        group_values=lambda i: i.rewards[:, None]))
    with pytest.raises(ValueError, match="give group_values too"):
        register_advantage_estimator(AdvantageEstimator("t_bad", "step", lambda i, s: i.rewards,
                                                        next_history=lambda groups, history: {}))
