"""Lock-step ``rollout.schedule.max_staleness=1`` equals a reference composed by hand from the loop's phases.

The reference generates the rollouts of steps 1 and 2 with the initial weights, trains step 1,
refits, recomputes pi_old of step 2's rollout at the updated weights, weights it with the
segment-level correction (recomputed here segment by segment from the log-probs, a second
algorithm), and takes one update. The async run must train on the same rollouts with the same
weights, reach the same gradient norms and end with the same policy (SSPO loss, tiny random Llama).
"""

import json
import math

import pytest
import torch

from nemo_sspo.algorithms.batch import response_to_target_frame
from nemo_sspo.megatron import destroy_parallel, export_hf_state_dict
from nemo_sspo.models import load_hf_checkpoint
from nemo_sspo.trainer.checkpoint import STATE_FILE
from tests.integration._loop_runs import generate, make_trainer, record_prepared

pytestmark = pytest.mark.fast  # seconds: kept in the fast tier (tests/conftest.py)

# lr large enough that one update moves pi_old visibly away from the engine's initial weights.
CORRECTED = ["rollout.correction.name=segment_tis", "rollout.correction.cap=1.5", "optim.lr=0.05"]


@pytest.fixture(scope="module")
def tiny():
    return load_hf_checkpoint("tiny-random-llama")


def _engine_logprobs(rollout, batch):
    rb = rollout.batch
    return response_to_target_frame(rb.rollout_logprobs, rb.prompt_mask, batch.loss_mask.shape[1])


def _segment_weights_by_hand(old, engine, mask, segments, cap):
    """min(geometric mean over each (row, segment) of pi_old / mu, cap), 1 off the mask, in float64."""
    weights = torch.ones(old.shape, dtype=torch.float64)
    for row in range(old.shape[0]):
        for seg in segments[row][mask[row]].unique().tolist():
            cols = mask[row] & (segments[row] == seg)
            mean_log = float((old[row, cols].double() - engine[row, cols].double()).mean())
            weights[row, cols] = min(math.exp(mean_log), cap)
    return weights


def _async_run(monkeypatch, tmp_path, tiny):
    trainer = make_trainer(monkeypatch, tmp_path / "async", [*CORRECTED, "rollout.schedule.max_staleness=1",
                                                              "trainer.checkpoint_interval=1"], checkpoint=tiny)
    trained = []
    record_prepared(trainer, trained)
    try:
        history = trainer.fit()
        return history, trained, export_hf_state_dict(trainer.model.module, trainer.hf_config)
    finally:
        destroy_parallel()


def _reference(monkeypatch, tmp_path, tiny):
    trainer = make_trainer(monkeypatch, tmp_path / "ref", CORRECTED, checkpoint=tiny)
    try:
        first, second = generate(trainer, 1), generate(trainer, 2)  # both from the initial weights
        batch1, _ = trainer.prepare_batch(first, *trainer.compute_advantages(first))
        _, norm1 = trainer.policy.update(batch1)
        trainer.source.push_weights()
        batch2, _ = trainer.prepare_batch(second, *trainer.compute_advantages(second))  # pi_old at the weights after step 1
        _, norm2 = trainer.policy.update(batch2)
        policy = export_hf_state_dict(trainer.model.module, trainer.hf_config)
        trainer.close()
        return (first, batch1, norm1), (second, batch2, norm2), policy
    finally:
        destroy_parallel()


def test_lock_step_staleness_one_equals_hand_composed_reference(monkeypatch, tmp_path, tiny):
    history, trained, policy = _async_run(monkeypatch, tmp_path, tiny)
    (r1, b1, norm1), (r2, b2, norm2), ref_policy = _reference(monkeypatch, tmp_path, tiny)

    # Step 1 is on policy (lag 0): engine and trainer agree to float rounding, weights ~1.
    # Step 2 trains on a rollout one update old (lag 1): pi_old moved away from mu.
    assert [h["rollout/version_lag_mean"] for h in history] == [0.0, 1.0]
    assert [h["rollout/version_lag_max"] for h in history] == [0.0, 1.0]
    gap1 = (_engine_logprobs(r1, b1) - b1.old_logprobs)[b1.loss_mask].abs().max()
    gap2 = (_engine_logprobs(r2, b2) - b2.old_logprobs)[b2.loss_mask].abs().max()
    assert gap1 < 1e-4 < 1e-2 < gap2

    # The correction of step 2, segment by segment from the log-probs.
    by_hand = _segment_weights_by_hand(b2.old_logprobs, _engine_logprobs(r2, b2), b2.loss_mask, b2.segment_ids, 1.5)
    torch.testing.assert_close(b2.tis_weights.double(), by_hand, rtol=1e-5, atol=0)
    assert (by_hand[b2.loss_mask] - 1).abs().max() > 1e-2  # the correction is not a no-op here

    # The async run trained on the same rollouts, pi_old and weights as the reference.
    for (rollout, batch), (ref_rollout, ref_batch) in zip(trained, [(r1, b1), (r2, b2)], strict=True):
        assert torch.equal(rollout.batch.response_ids, ref_rollout.batch.response_ids)
        torch.testing.assert_close(batch.old_logprobs, ref_batch.old_logprobs, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(batch.tis_weights, ref_batch.tis_weights, rtol=1e-5, atol=0)
    for record, norm in zip(history, [norm1, norm2], strict=True):
        assert record["optim/grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert history[1]["rollout/is_weight"] == pytest.approx(float(by_hand[b2.loss_mask].mean()), rel=1e-5)
    # ESS/N = mean(w)^2 / mean(w^2) over the tokens
    w = by_hand[b2.loss_mask]
    assert history[1]["rollout/is_ess"] == pytest.approx(float(w.mean() ** 2 / (w ** 2).mean()), rel=1e-5)
    # The step-1 checkpoint keeps the data position of step 1 (2 prompts), not of step 2, already in flight.
    state = json.loads((tmp_path / "async" / "checkpoints" / "step_000001" / STATE_FILE).read_text())
    assert state["problems_drawn"] == 2
    for name, tensor in ref_policy.items():
        torch.testing.assert_close(policy[name], tensor, rtol=1e-5, atol=1e-7, msg=name)
