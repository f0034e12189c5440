"""HF rollout engine on the tiny random Llama: shapes, masks, log-probs, seeding, weight refit."""

import pytest
import torch

from nemo_sspo.models import build_hf_model, load_hf_checkpoint
from nemo_sspo.rollout import HFRolloutEngine

PROMPTS = ["Tom has 3 apples.", "What is 2 + 2? Answer with one number only, please."]
MAX_NEW = 12


@pytest.fixture(scope="module")
def tiny():
    return load_hf_checkpoint("tiny-random-llama")


@pytest.fixture(scope="module")
def engine(tiny):
    config, state_dict, tokenizer = tiny
    return HFRolloutEngine(build_hf_model(config, state_dict), tokenizer, max_new_tokens=MAX_NEW,
                           temperature=0.7)


@pytest.fixture(scope="module")
def batch(engine):
    return engine.generate(PROMPTS, seed=3)


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def test_prompt_left_padding(batch, tiny):
    tokenizer = tiny[2]
    lengths = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in PROMPTS]
    assert batch.prompt_ids.shape == (2, max(lengths)) and batch.prompt_ids.dtype == torch.int64
    assert batch.prompt_mask.sum(1).tolist() == lengths
    for row, n in enumerate(lengths):  # pads on the left only
        assert batch.prompt_mask[row, -n:].all() and not batch.prompt_mask[row, :-n].any()
        assert (batch.prompt_ids[row, :-n] == tokenizer.pad_token_id).all()


def test_response_shapes_and_masks(batch, tiny):
    eos = tiny[2].eos_token_id
    B, T = batch.response_ids.shape
    assert B == 2 and T <= MAX_NEW and batch.response_ids.dtype == torch.int64
    assert batch.response_mask.dtype == torch.bool and batch.rollout_logprobs.dtype == torch.float32
    for row in range(B):
        mask, ids = batch.response_mask[row], batch.response_ids[row]
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any()  # a prefix
        has_eos = bool((ids[:n] == eos).any())
        assert batch.truncated[row].item() == (not has_eos)
        if has_eos:
            assert ids[n - 1] == eos and not (ids[:n - 1] == eos).any()
        else:
            assert n == MAX_NEW
        assert (ids[n:] == tiny[2].pad_token_id).all()
        assert (batch.rollout_logprobs[row, n:] == 0).all()
    assert len(batch.response_texts) == 2


def test_mask_through_first_eos(engine):
    # Hand-made rows (eos = 2): [5, 2, 2, 2] -> mask [T, T, F, F]; [5, 6, 7, 8] -> all True, truncated.
    ids = torch.tensor([[5, 2, 2, 2], [5, 6, 7, 8], [2, 9, 2, 2]])
    mask, truncated = engine._response_mask(ids)
    assert mask.tolist() == [[True, True, False, False], [True] * 4, [True, False, False, False]]
    assert truncated.tolist() == [False, True, False]


def test_rollout_logprobs_match_forward(engine, batch):
    # Independent recomputation: one full forward over prompt + response, log_softmax(logits / 0.7).
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask], dim=1)
    with torch.no_grad():
        logits = engine.model(input_ids=ids, attention_mask=mask.long(), position_ids=_positions(mask)).logits
    P = batch.prompt_ids.shape[1]
    logp = torch.log_softmax(logits[:, P - 1:-1].double() / 0.7, dim=-1)
    expected = logp.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    expected = torch.where(batch.response_mask, expected, 0.0)
    torch.testing.assert_close(batch.rollout_logprobs.double(), expected, atol=2e-4, rtol=0)


def test_top_p_logprobs_renormalised_p14(tiny):
    # With top_p < 1 the kept support is renormalised, so each rollout log-prob is >= the
    # full-vocabulary one (docs/pitfalls.md#p14: probs [.5, .3, .2], top_p .8 -> log .625 > log .5).
    config, state_dict, tokenizer = tiny
    nucleus = HFRolloutEngine(build_hf_model(config, state_dict), tokenizer, max_new_tokens=6,
                              temperature=1.0, top_p=0.5)
    a = nucleus.generate(PROMPTS, seed=0)
    ids = torch.cat([a.prompt_ids, a.response_ids], 1)
    mask = torch.cat([a.prompt_mask, a.response_mask], 1)
    with torch.no_grad():
        logits = nucleus.model(input_ids=ids, attention_mask=mask.long(), position_ids=_positions(mask)).logits
    P = a.prompt_ids.shape[1]
    trainer = torch.log_softmax(logits[:, P - 1:-1], -1).gather(-1, a.response_ids.unsqueeze(-1)).squeeze(-1)
    gap = (a.rollout_logprobs - trainer)[a.response_mask]
    assert (gap >= -1e-4).all() and gap.max() > 1e-3
    # Second algorithm, float64: the nucleus is the most likely tokens, in descending order, whose
    # preceding mass is below top_p; the rollout log-prob is log p_t - log(mass of the nucleus).
    probs = torch.softmax(logits[:, P - 1:-1].double(), -1)
    sorted_probs, _ = probs.sort(-1, descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    nucleus_mass = torch.where(mass_before < 0.5, sorted_probs, 0.0).sum(-1)
    expected = (probs.gather(-1, a.response_ids.unsqueeze(-1)).squeeze(-1) / nucleus_mass).log()
    expected = torch.where(a.response_mask, expected, 0.0)
    # atol 1e-5: float32 cached generation against one full forward differs by 7e-7 here, while
    # the renormalisation moves log-probs by more than 1e-3 (the gap above).
    torch.testing.assert_close(a.rollout_logprobs.double(), expected, atol=1e-5, rtol=0)


def test_seeded_and_global_rng_untouched(engine, batch):
    torch.manual_seed(11)
    expected_next = torch.rand(2)
    torch.manual_seed(11)
    again = engine.generate(PROMPTS, seed=3)
    assert torch.equal(torch.rand(2), expected_next)
    assert torch.equal(again.response_ids, batch.response_ids)
    assert again.response_texts == batch.response_texts


def test_load_weights_refits_in_place(tiny):
    config, state_dict, tokenizer = tiny
    engine = HFRolloutEngine(build_hf_model(config, state_dict), tokenizer, max_new_tokens=4, temperature=1.0)
    generator = torch.Generator().manual_seed(5)
    new_weights = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in state_dict.items()}
    embedding = engine.model.model.embed_tokens.weight
    engine.load_weights(new_weights)
    assert engine.model.model.embed_tokens.weight is embedding  # same storage: copied in place
    reference = build_hf_model(config, new_weights)
    ids = torch.tensor([[1, 400, 500, 600]])
    with torch.no_grad():
        torch.testing.assert_close(engine.model(input_ids=ids).logits, reference(input_ids=ids).logits,
                                   atol=0, rtol=0)
        # ...and they really changed: the old weights give different logits.
        old = build_hf_model(config, state_dict)(input_ids=ids).logits
    assert (old - reference(input_ids=ids).logits).abs().max() > 1e-3


def test_load_weights_strict(engine, tiny):
    state_dict = tiny[1]
    with pytest.raises(ValueError, match="missing"):
        engine.load_weights({k: v for k, v in state_dict.items() if k != "model.norm.weight"})
    bad_shape = {**state_dict, "model.norm.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights(bad_shape)


def test_load_weight_buckets_equals_one_load_and_sets_every_parameter_once(tiny):
    config, state_dict, tokenizer = tiny
    generator = torch.Generator().manual_seed(6)
    new_weights = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in state_dict.items()}
    names = list(new_weights)
    buckets = [{n: new_weights[n] for n in names[i:i + 3]} for i in range(0, len(names), 3)]
    streamed = HFRolloutEngine(build_hf_model(config, state_dict), tokenizer, max_new_tokens=4, temperature=1.0)
    streamed.load_weight_buckets(iter(buckets))
    for name, value in build_hf_model(config, new_weights).state_dict().items():
        assert torch.equal(streamed.model.state_dict()[name], value), name
    with pytest.raises(ValueError, match="already loaded"):
        streamed.load_weight_buckets([buckets[0], buckets[0]])
    with pytest.raises(ValueError, match="missing"):
        streamed.load_weight_buckets(buckets[:-1])


@pytest.mark.parametrize("kwargs, name", [
    (dict(max_new_tokens=0, temperature=1.0), "max_new_tokens"),
    (dict(max_new_tokens=4, temperature=0.0), "temperature"),
    (dict(max_new_tokens=4, temperature=1.0, top_p=1.5), "top_p"),
    (dict(max_new_tokens=4, temperature=1.0, top_k=-1), "top_k"),
])
def test_bad_settings(engine, tiny, kwargs, name):
    with pytest.raises(ValueError, match=name):
        HFRolloutEngine(engine.model, tiny[2], **kwargs)


def test_nan_logprob_from_the_hf_engine_is_refused_naming_row_and_position(tiny, monkeypatch):
    """An fp16 engine whose logits overflow yields NaN scores; the HF engine's results pass the same
    check as vLLM's (nemo_sspo.rollout.hf_engine.check_engine_outputs). Row 1, position 0 is poisoned."""
    config, state_dict, tokenizer = tiny
    engine = HFRolloutEngine(build_hf_model(config, state_dict), tokenizer, max_new_tokens=3, temperature=1.0)
    sampled = HFRolloutEngine._sampled_logprobs

    def poisoned(scores, response_ids):
        logprobs = sampled(scores, response_ids)
        logprobs[1, 0] = float("nan")
        return logprobs

    monkeypatch.setattr(engine, "_sampled_logprobs", poisoned)
    with pytest.raises(ValueError, match=r"rollout engine 'hf' returned log-prob nan for token id \d+ at row 1, "
                                         r"response position 0"):
        engine.generate(PROMPTS, seed=3)
