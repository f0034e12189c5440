"""The vLLM rollout backend without vLLM: sampling parameters, output conversion from stand-ins
built per vLLM's documented ``RequestOutput`` / ``CompletionOutput`` / ``Logprob`` attributes, refit
through ``LLM.apply_model``, and the error when vllm is missing."""

import sys
from types import SimpleNamespace

import pytest
import torch

from nemo_sspo.models import load_hf_checkpoint
from nemo_sspo.rollout.vllm_engine import (
    VLLMRolloutEngine,
    import_vllm,
    rollout_batch_from_outputs,
    vllm_sampling_kwargs,
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_hf_checkpoint("tiny-random-llama")[2]


def _completion(token_ids, logprobs, finish_reason):
    """A ``CompletionOutput`` stand-in: ``logprobs`` holds one ``{token_id: Logprob}`` per token."""
    steps = [{tok: SimpleNamespace(logprob=lp, rank=1, decoded_token="")} for tok, lp in zip(token_ids, logprobs)]
    return SimpleNamespace(token_ids=token_ids, logprobs=steps, finish_reason=finish_reason, text="")


def _request(*completion_args):
    return SimpleNamespace(outputs=[_completion(*completion_args)])


def test_sampling_kwargs_are_neutral_except_temperature():
    kwargs = vllm_sampling_kwargs(max_new_tokens=16, temperature=0.7, seed=5, eos_token_id=2)
    assert kwargs == dict(n=1, temperature=0.7, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0,
                          presence_penalty=0.0, frequency_penalty=0.0, max_tokens=16, seed=5, logprobs=0,
                          stop_token_ids=[2])


@pytest.mark.parametrize("truncation", [dict(top_p=0.9), dict(top_k=20)])
def test_truncated_sampling_is_refused_unless_corrected(truncation):
    with pytest.raises(ValueError, match="rollout.tis_cap"):
        vllm_sampling_kwargs(max_new_tokens=4, temperature=1.0, seed=0, eos_token_id=2, **truncation)
    kwargs = vllm_sampling_kwargs(max_new_tokens=4, temperature=1.0, seed=0, eos_token_id=2,
                                  truncation_corrected=True, **truncation)
    assert (kwargs["top_p"], kwargs["top_k"]) == (truncation.get("top_p", 1.0), truncation.get("top_k", -1))


def test_outputs_become_a_padded_rollout_batch(tokenizer):
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    prompt_ids = torch.tensor([[pad, 5, 6], [7, 8, 9]])
    prompt_mask = prompt_ids != pad
    prompt_mask[1] = True
    outputs = [_request([11, 12, eos], [-0.5, -1.0, -0.25], "stop"),  # stopped at EOS (kept, as HF does)
               _request([13, 14, 15, 16], [-2.0, -0.1, -0.2, -0.3], "length")]  # hit max_tokens
    batch = rollout_batch_from_outputs(outputs, prompt_ids, prompt_mask, tokenizer)
    assert batch.response_ids.tolist() == [[11, 12, eos, pad], [13, 14, 15, 16]]
    assert batch.response_mask.tolist() == [[True, True, True, False], [True] * 4]
    assert batch.truncated.tolist() == [False, True]
    torch.testing.assert_close(batch.rollout_logprobs,
                               torch.tensor([[-0.5, -1.0, -0.25, 0.0], [-2.0, -0.1, -0.2, -0.3]]))
    assert batch.response_texts == tokenizer.batch_decode(batch.response_ids, skip_special_tokens=True)
    assert batch.prompt_ids is prompt_ids


@pytest.mark.parametrize("broken, match", [
    (SimpleNamespace(token_ids=[1], logprobs=None, finish_reason="stop"), "logprobs=0"),
    (_completion([1], [-1.0], "abort"), "abort"),
])
def test_bad_outputs_are_refused(tokenizer, broken, match):
    with pytest.raises(ValueError, match=match):
        rollout_batch_from_outputs([SimpleNamespace(outputs=[broken])], torch.ones(1, 2, dtype=torch.long),
                                   torch.ones(1, 2, dtype=torch.bool), tokenizer)


class _FakeLLM:
    """Records ``generate`` requests and runs ``apply_model`` functions on a recording model."""

    def __init__(self):
        self.requests = self.params = None
        self.model = SimpleNamespace(loaded=None)
        self.model.load_weights = lambda weights: setattr(self.model, "loaded", list(weights))

    def generate(self, requests, params, use_tqdm):
        self.requests, self.params = requests, params
        return [_request([21, 22], [-1.0, -2.0], "length") for _ in requests]

    def apply_model(self, fn):
        return [fn(self.model)]


def test_engine_generates_per_row_seeds_and_refits(monkeypatch, tokenizer):
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kwargs: kwargs))
    llm = _FakeLLM()
    engine = VLLMRolloutEngine(llm, tokenizer, max_new_tokens=2, temperature=1.0)
    batch = engine.generate(["a b", "a b c"], seed=7)
    expected = [tokenizer("a b", add_special_tokens=False)["input_ids"],
                tokenizer("a b c", add_special_tokens=False)["input_ids"]]
    assert [r["prompt_token_ids"] for r in llm.requests] == expected  # unpadded ids, no special tokens
    assert [p["seed"] for p in llm.params] == [7, 8]
    assert batch.truncated.tolist() == [True, True] and batch.response_ids.shape == (2, 2)
    weights = {"model.norm.weight": torch.ones(3)}
    engine.load_weights(weights)
    assert [name for name, _ in llm.model.loaded] == ["model.norm.weight"]


def test_missing_vllm_names_the_config_key(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(ValueError, match="rollout.backend"):
        import_vllm()
