"""Partial rollouts on the tiny random Llama: a response stopped at a refit and continued with the
new weights keeps, token by token, the log-prob and version of the weights that sampled it, and the
off-policy corrections computed from it match a float64 hand reference; the bound and the metrics
read a response's oldest token."""

import math

import pytest
import torch

from nemo_sspo.algorithms.off_policy import off_policy_weights
from nemo_sspo.models import build_hf_model, load_hf_checkpoint
from nemo_sspo.rollout import HFRolloutEngine, RolloutBatch
from nemo_sspo.rollout.partial import RolloutStopped, continuation_seed, generate_with_refits
from nemo_sspo.rollouts.slots import concat_rollouts
from nemo_sspo.rollouts.records import Rollout
from nemo_sspo.rollouts.records import VersionedRollout
from nemo_sspo.rollouts.staleness import partial_sums, version_lag_sums

PROMPTS = ["Tom has 3 apples.", "What is 2 + 2?"]
MAX_NEW = 8
SPLIT = 3  # decode steps before the refit


@pytest.fixture(scope="module")
def tiny():
    return load_hf_checkpoint("tiny-random-llama")


def _engine(tiny):
    config, state_dict, tokenizer = tiny
    return HFRolloutEngine(build_hf_model(config, state_dict), tokenizer, max_new_tokens=MAX_NEW, temperature=1.0)


def _shifted(state_dict):
    """Version 1: every floating weight moved by 0.2 of its own std (a different policy)."""
    return {name: (t + 0.2 * t.float().std() * torch.randn(t.shape, generator=torch.Generator().manual_seed(i))
                   ).to(t.dtype) if t.is_floating_point() and t.numel() > 1 else t
            for i, (name, t) in enumerate(state_dict.items())}


def _forward_logprobs(config, state_dict, batch: RolloutBatch) -> torch.Tensor:
    """Float64 reference: log-softmax of one full forward of ``state_dict`` at the sampled tokens."""
    model = build_hf_model(config, state_dict).double().eval()
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=(mask.long().cumsum(-1) - 1).clamp(min=0)
                       ).logits
    width = batch.prompt_ids.shape[1]
    logp = torch.log_softmax(logits[:, width - 1:-1], dim=-1).gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    return torch.where(batch.response_mask, logp, 0.0)


def test_an_uninterrupted_partial_generation_is_the_engine_generate(tiny):
    engine = _engine(tiny)
    whole = engine.generate(PROMPTS, seed=5)
    partial = generate_with_refits(engine, PROMPTS, seed=5, version=4, max_new_tokens=MAX_NEW, interrupt=lambda: False,
                                   refit=lambda: pytest.fail("no refit without an interruption"),
                                   pad_id=tiny[2].pad_token_id,
                                   decode=lambda ids: tiny[2].batch_decode(ids, skip_special_tokens=True))
    assert torch.equal(partial.response_ids, whole.response_ids) and partial.response_texts == whole.response_texts
    assert torch.equal(partial.rollout_logprobs, whole.rollout_logprobs)
    assert partial.token_versions.tolist() == torch.where(whole.response_mask, 4, -1).tolist()
    assert continuation_seed(5, 0) == 5 and continuation_seed(5, 1) != continuation_seed(5, 2)


def test_a_response_continued_across_a_refit_keeps_each_tokens_version_and_log_prob(tiny):
    config, state_dict, tokenizer = tiny
    engine, new_weights = _engine(tiny), _shifted(state_dict)
    polls = []

    def interrupt():  # new weights wait once SPLIT tokens are sampled (polled after each decode step)
        polls.append(1)
        return len(polls) == SPLIT

    def refit():
        engine.load_weights(new_weights)
        return 1

    batch = generate_with_refits(engine, PROMPTS, seed=5, version=0, max_new_tokens=MAX_NEW, interrupt=interrupt,
                                 refit=refit, pad_id=tokenizer.pad_token_id,
                                 decode=lambda ids: tokenizer.batch_decode(ids, skip_special_tokens=True))
    mask = batch.response_mask
    assert mask.sum(dim=1).tolist() == [MAX_NEW, MAX_NEW]  # random weights: no stop id within 8 tokens
    assert batch.token_versions.tolist() == [[0] * SPLIT + [1] * (MAX_NEW - SPLIT)] * 2
    old, new = _forward_logprobs(config, state_dict, batch), _forward_logprobs(config, new_weights, batch)
    behaviour = torch.where(batch.token_versions == 0, old, new)
    torch.testing.assert_close(batch.rollout_logprobs.double(), behaviour, atol=2e-4, rtol=0)
    assert (old[:, SPLIT:] - new[:, SPLIT:]).abs().max() > 1e-2  # the versions really differ there

    # The trainer after version 1's update holds pi_old = version 1: tokens it sampled weigh 1, the
    # first SPLIT tokens exp(log pi_1 - log pi_0); the sequence weight multiplies only those.
    weights, _ = off_policy_weights("token_tis", new.float(), batch.rollout_logprobs, mask, cap=1e9)
    expected = torch.exp(new - behaviour)
    torch.testing.assert_close(weights.double(), expected, atol=1e-3, rtol=1e-3)
    assert torch.allclose(weights[:, SPLIT:], torch.ones(2, MAX_NEW - SPLIT), atol=1e-3)
    sequence, _ = off_policy_weights("sequence_tis", new.float(), batch.rollout_logprobs, mask, cap=1e9)
    by_hand = [math.exp(float((new[b, :SPLIT] - old[b, :SPLIT]).sum())) for b in range(2)]
    torch.testing.assert_close(sequence[:, 0].double(), torch.tensor(by_hand, dtype=torch.float64), rtol=2e-3, atol=0)
    segments = torch.where(mask, (torch.arange(MAX_NEW) >= SPLIT).long()[None].expand(2, -1), -1)  # the two stretches
    segment, _ = off_policy_weights("segment_tis", new.float(), batch.rollout_logprobs, mask, segment_ids=segments,
                                    cap=1e9)
    first = [math.exp(float((new[b, :SPLIT] - old[b, :SPLIT]).mean())) for b in range(2)]
    torch.testing.assert_close(segment[:, 0].double(), torch.tensor(first, dtype=torch.float64), rtol=2e-3, atol=0)
    assert torch.allclose(segment[:, SPLIT:], torch.ones(2, MAX_NEW - SPLIT), atol=1e-3)


def test_the_stop_abandons_unfinished_responses(tiny):
    engine = _engine(tiny)
    with pytest.raises(RolloutStopped, match="2 unfinished response"):
        generate_with_refits(engine, PROMPTS, seed=5, version=0, max_new_tokens=MAX_NEW, interrupt=lambda: True,
                             refit=lambda: None, pad_id=tiny[2].pad_token_id, decode=lambda ids: ["", ""])


def test_generate_partial_refuses_a_prefix_at_the_cap(tiny):
    with pytest.raises(ValueError, match="each shorter than max_new_tokens=8"):
        _engine(tiny).generate_partial(PROMPTS, [torch.zeros(8, dtype=torch.int64)] * 2, seed=1)


def _response(versions: list[int]) -> Rollout:
    n = len(versions)
    batch = RolloutBatch(prompt_ids=torch.ones(1, 1, dtype=torch.int64), prompt_mask=torch.ones(1, 1, dtype=torch.bool),
                         response_ids=torch.ones(1, n, dtype=torch.int64), response_mask=torch.ones(1, n, dtype=torch.bool),
                         truncated=torch.zeros(1, dtype=torch.bool), response_texts=["x"],
                         rollout_logprobs=torch.zeros(1, n), token_versions=torch.tensor([versions]))
    return Rollout(batch=batch, task_rewards=torch.zeros(1), rewards=torch.zeros(1), rounds=1, generated_groups=1,
                   prompt_keys=["00" * 16])


def test_lag_and_partial_share_read_each_responses_oldest_token():
    # Responses [2, 2, 3] (continued after a refit) and [3, 3] stacked, padded with -1, for step 5
    # (from version 4): oldest tokens 2 and 3 -> lags 2 and 1; one of the two responses is partial.
    a, b = _response([2, 2, 3]), _response([3, 3])
    batch = concat_rollouts([a.batch, b.batch], pad_id=0)
    assert batch.token_versions.tolist() == [[2, 2, 3], [3, 3, -1]]
    rollout = Rollout(batch=batch, task_rewards=torch.zeros(2), rewards=torch.zeros(2), rounds=1, generated_groups=2,
                      prompt_keys=["00" * 16] * 2)
    versioned = VersionedRollout(rollout, version=2, problems_drawn=0)
    assert versioned.versions().tolist() == [2, 3]
    lags = version_lag_sums(versioned, 5)
    assert lags["rollout/version_lag_mean"].as_tensor().tolist() == [3.0, 2.0]
    assert partial_sums(versioned)["rollout/partial_share"].as_tensor().tolist() == [1.0, 2.0]
    assert partial_sums(VersionedRollout(_response([1]), version=1, problems_drawn=0))[
        "rollout/partial_share"].as_tensor().tolist() == [0.0, 1.0]
