"""Reference-policy KL in the loop: a frozen copy of the initial policy only when kl_coef > 0; on
step 1 its log-probs equal the old-policy log-probs (and the rollout engine's, an independent
implementation) and the KL is 0; after an update the KL is positive."""

import pytest
import torch

from nemo_sspo.models import load_hf_checkpoint
from nemo_sspo.algorithms.batch import response_to_target_frame
from tests.integration._loop_runs import record_prepared, run


@pytest.fixture(scope="module")
def checkpoint():
    return load_hf_checkpoint("tiny-random-llama")


def _initial_policy_logprobs(checkpoint, batch, temperature):
    """log pi_init of ``batch.targets`` with a transformers model holding the initial weights ([B, S])."""
    from transformers import AutoModelForCausalLM

    hf_config, state_dict, _ = checkpoint
    model = AutoModelForCausalLM.from_config(hf_config).float()
    model.load_state_dict(state_dict, strict=False)
    model.eval()
    with torch.no_grad():  # right padding: valid positions never attend to it under the causal mask
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits.float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)


def _record_batches(store, flags):
    def capture(trainer):
        flags["has_reference"] = trainer.ref_model is not None
        flags["temperature"] = trainer.cfg.rollout.sampling.temperature
        record_prepared(trainer, store)

    return capture


def test_reference_logprobs_and_kl(checkpoint, monkeypatch, tmp_path):
    seen, flags = [], {}
    # One update per step, so step 1's only update sees policy == reference.
    history = run(monkeypatch, tmp_path, ["loss=grpo", "loss.params.kl_coef=0.1", "optim.lr=1e-2",
                                          "trainer.minibatches_per_step=1"],
                  checkpoint=checkpoint, capture=_record_batches(seen, flags))
    assert flags["has_reference"]
    (rollout, batch), _ = seen
    mask = batch.loss_mask
    assert batch.ref_logprobs.shape == batch.old_logprobs.shape and batch.ref_logprobs.dtype == torch.float32
    assert torch.equal(batch.ref_logprobs, batch.old_logprobs)  # same weights, same code path
    assert not batch.ref_logprobs[~mask].any()
    # Independent: the HF rollout model's log-probs of the same tokens (transformers, not Megatron).
    rb = rollout.batch
    hf = response_to_target_frame(rb.rollout_logprobs, rb.prompt_mask, mask.shape[1])
    assert (hf - batch.ref_logprobs)[mask].abs().max() < 1e-4
    step1, step2 = history
    assert step1["policy/kl_ref"] == pytest.approx(0.0, abs=1e-7)
    assert step2["policy/kl_ref"] > 1e-6  # the policy moved away from the frozen reference
    # Step 2's reference log-probs are the initial policy's: recomputed here with transformers from
    # the initial weights on step 2's tokens (logits / temperature, full-vocabulary log-softmax).
    # Its old log-probs come from the updated policy and differ by far more than that tolerance.
    (_, batch2) = seen[1]
    mask2 = batch2.loss_mask
    initial = _initial_policy_logprobs(checkpoint, batch2, flags["temperature"])
    assert (initial - batch2.ref_logprobs)[mask2].abs().max() < 1e-4
    assert (batch2.old_logprobs - batch2.ref_logprobs)[mask2].abs().max() > 1e-2


def test_no_reference_model_without_kl(checkpoint, monkeypatch, tmp_path):
    seen, flags = [], {}
    run(monkeypatch, tmp_path, ["loss=grpo", "trainer.max_steps=1"], checkpoint=checkpoint,
        capture=_record_batches(seen, flags))
    assert not flags["has_reference"] and seen[0][1].ref_logprobs is None
