"""Every registered loss trains 2 steps in the CPU loop (tiny random Llama, in-process, one shared
checkpoint load) and reports finite values for every metric it should.

Expected keys: the trainer's own (rollout, reward, timing, optimiser, advantages or critic) plus
every key the loss itself emits on a plain-tensor call (and the ``_std`` derived from its ``_sq``
keys), so a loss whose metrics get lost between the loss and metrics.jsonl fails here.
"""

import math

import pytest
import torch

from nemo_sspo.algorithms.losses import LossInputs, get_policy_loss, make_policy_loss, policy_loss_names
from nemo_sspo.models import load_hf_checkpoint
from tests.integration._loop_runs import TINY, record_updates, run
from tests.unit.loss_cases import hand_aggregate, loss_case

TRAINER_KEYS = {
    "reward/mean", "reward/accuracy", "response/length_mean", "response/truncated_frac",
    "rollout/sampling_rounds", "rollout/kept_group_frac", "rollout/trainer_logprob_gap_abs",
    "loss/policy", "policy/approx_kl_k3", "optim/grad_norm", "timing/generation_s", "timing/train_s",
    "timing/refit_s",
}
GROUP_KEYS = {"advantages/zero_variance_group_frac"}
CRITIC_KEYS = {"critic/loss", "critic/value_mean", "critic/reward_mean", "critic/abs_error",
               "critic/grad_norm", "timing/critic_s"}
# A critic loss's setting (SPPO's): one response per prompt (its critic is the baseline).
CRITIC_OVERRIDES = ["rollout.samples_per_prompt=1", "rollout.prompts_per_step=4", "critic.micro_batch_size=2"]


@pytest.fixture(scope="module")
def checkpoint():
    return load_hf_checkpoint("tiny-random-llama")


def _loss_keys(name: str) -> set[str]:
    """Metric keys the loss emits (with the current-policy entropy the trainer passes)."""
    mask = torch.ones(2, 3, dtype=torch.bool)
    lp = torch.full((2, 3), -1.0)
    metrics = make_policy_loss(name)(LossInputs(
        logprobs=lp, old_logprobs=lp, advantages=torch.tensor([1.0, -1.0]), response_mask=mask,
        segment_ids=torch.zeros(2, 3, dtype=torch.long), old_entropy=torch.ones(2, 3),
        entropy=torch.ones(2, 3))).metrics
    return set(metrics) | {k[: -len("_sq")] + "_std" for k in metrics if k.endswith("_sq")}


@pytest.mark.slow
@pytest.mark.parametrize("name", policy_loss_names())
def test_two_steps_of_every_loss(name, checkpoint, monkeypatch, tmp_path):
    updates = []
    record_updates(monkeypatch, updates)
    needs, case = make_policy_loss(name).requirements, loss_case(name)
    critic = needs.advantage_source == "critic"
    history = run(monkeypatch, tmp_path, [f"loss={name}", *(CRITIC_OVERRIDES if critic else [])],
                  checkpoint=checkpoint)
    expected = TRAINER_KEYS | _loss_keys(name)
    expected |= CRITIC_KEYS if critic else GROUP_KEYS
    assert [r["step"] for r in history] == [1, 2]
    for record in history:
        assert expected <= set(record), sorted(expected - set(record))
        assert all(math.isfinite(v) for v in record.values()), {k: v for k, v in record.items() if not math.isfinite(v)}
        assert record["optim/grad_norm"] > 0
        # Same weights, fp32: rollout and trainer log-probs differ by rounding only.
        assert record["rollout/trainer_logprob_gap_abs"] < 1e-3
    # The first of a step's two mini-batches is on-policy: the trainer computed pi_old with the same
    # weights and the same micro-batches, so every token log-ratio is exactly 0: every ratio is 1,
    # both KL estimates are 0, and each token's loss is the row's on_policy_value (-A_i for ratio
    # losses, docs/algorithms.md; tests/unit/loss_cases.py), reduced by hand.
    assert len(updates) == 4  # 2 steps x 2 mini-batches
    config = get_policy_loss(name).config_cls()
    max_new_tokens = int(next(o for o in TINY if o.startswith("rollout.sampling.max_new_tokens=")).split("=")[1])
    for batch, sums in (updates[0], updates[2]):
        for level in ("token", "segment", "response"):
            assert sums[f"policy/ratio_{level}_min"].total.item() == 1.0, level
            assert sums[f"policy/ratio_{level}_max"].total.item() == 1.0, level
        assert sums["policy/approx_kl_k1"].total.item() == 0.0 and sums["policy/approx_kl_k3"].total.item() == 0.0
        numerator, denominator = sums["loss/policy"].as_tensor(torch.float64).tolist()
        per_token = case.on_policy_value(batch.advantages.double(), batch.old_logprobs.double())
        expected, count = hand_aggregate(per_token, batch.loss_mask, config.aggregation, max_new_tokens)
        assert denominator == count
        if not case.zeroes_random_tokens:  # else the loss of a seeded random pick of tokens is 0
            assert numerator / denominator == pytest.approx(expected, rel=1e-5, abs=1e-6)
    # The second mini-batch follows an optimizer step: some token ratio differs from 1.
    _, second = updates[1]
    assert second["policy/ratio_token_min"].total.item() < 1.0 or second["policy/ratio_token_max"].total.item() > 1.0
    if needs.dynamic_sampling:  # loss=dapo turns on dynamic sampling: no zero-variance group is trained on
        assert all(r["advantages/zero_variance_group_frac"] == 0.0 for r in history)
    else:
        assert all(r["rollout/sampling_rounds"] == 1.0 for r in history)
