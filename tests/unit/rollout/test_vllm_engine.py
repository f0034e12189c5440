"""The vLLM rollout backend's own logic without vLLM: sampling parameters, output conversion with the
stop list, refit through ``collective_rpc("reload_weights")`` + ``reset_prefix_cache``, process
isolation, engine settings, and the error when vllm is missing. Stand-ins follow vLLM's documented
``RequestOutput`` / ``CompletionOutput`` / ``Logprob`` attributes; tests/vllm runs the real engine."""

import os
import random
import re
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from nemo_sspo.models import load_hf_checkpoint
from nemo_sspo.rollout.vllm_engine import (
    VLLMRolloutEngine,
    build_llm,
    import_vllm,
    preserve_process_state,
    rollout_batch_from_outputs,
    vllm_sampling_kwargs,
)

VOCAB = 49152  # the tiny random Llama's embedding rows (SmolLM2's vocabulary)


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
    kwargs = vllm_sampling_kwargs(max_new_tokens=16, temperature=0.7, seed=5, stop_token_ids=[7, 2, 7])
    assert kwargs == dict(n=1, temperature=0.7, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0,
                          presence_penalty=0.0, frequency_penalty=0.0, max_tokens=16, seed=5, logprobs=0,
                          stop_token_ids=[2, 7])
    with pytest.raises(ValueError, match="stop_token_ids is empty"):
        vllm_sampling_kwargs(max_new_tokens=16, temperature=0.7, seed=5, stop_token_ids=[])


@pytest.mark.parametrize("truncation", [dict(top_p=0.9), dict(top_k=20)])
def test_truncated_sampling_is_refused_unless_corrected(truncation):
    with pytest.raises(ValueError, match="rollout.correction.name"):
        vllm_sampling_kwargs(max_new_tokens=4, temperature=1.0, seed=0, stop_token_ids=[2], **truncation)
    kwargs = vllm_sampling_kwargs(max_new_tokens=4, temperature=1.0, seed=0, stop_token_ids=[2],
                                  truncation_corrected=True, **truncation)
    assert (kwargs["top_p"], kwargs["top_k"]) == (truncation.get("top_p", 1.0), truncation.get("top_k", -1))


def test_outputs_become_a_padded_rollout_batch(tokenizer):
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    prompt_ids = torch.tensor([[pad, 5, 6], [7, 8, 9]])
    prompt_mask = prompt_ids != pad
    prompt_mask[1] = True
    outputs = [_request([11, 12, eos], [-0.5, -1.0, -0.25], "stop"),  # stopped at EOS (kept, as HF does)
               _request([13, 14, 15, 16], [-2.0, -0.1, -0.2, -0.3], "length")]  # hit max_tokens
    batch = rollout_batch_from_outputs(outputs, prompt_ids, prompt_mask, tokenizer, [eos], vocab_size=len(tokenizer),
                                       max_new_tokens=4)
    assert batch.response_ids.tolist() == [[11, 12, eos, pad], [13, 14, 15, 16]]
    assert batch.response_mask.tolist() == [[True, True, True, False], [True] * 4]
    assert batch.truncated.tolist() == [False, True]
    torch.testing.assert_close(batch.rollout_logprobs,
                               torch.tensor([[-0.5, -1.0, -0.25, 0.0], [-2.0, -0.1, -0.2, -0.3]]))
    assert batch.response_texts == tokenizer.batch_decode(batch.response_ids, skip_special_tokens=True)
    assert batch.prompt_ids is prompt_ids


def test_second_end_id_ends_the_response():
    # Qwen2.5: <|im_end|> 151645 is the tokenizer's EOS, <|endoftext|> 151643 the other declared end.
    # A response ending with 151643 must stop there (mask, truncation) like one ending with 151645.
    qwen = load_hf_checkpoint("tiny-random-qwen2")[2]
    from nemo_sspo.models.hf_folder import stop_token_ids

    stops = stop_token_ids(qwen)
    assert stops == [151643, 151645] and qwen.eos_token_id in stops
    ids = torch.tensor([[1, 2]])
    outputs = [_request([40, 41, 151643, 50, 51], [-1.0] * 5, "length")]  # ran on past the end id
    batch = rollout_batch_from_outputs(outputs, ids, ids > 0, qwen, stops, vocab_size=151936, max_new_tokens=5)
    assert batch.response_mask.sum().item() == 3 and batch.truncated.tolist() == [False]
    assert batch.response_ids.tolist() == [[40, 41, 151643]]


def test_missing_logprobs_and_aborted_requests_are_refused(tokenizer):
    wrong_token = SimpleNamespace(token_ids=[1, 3], logprobs=[{1: SimpleNamespace(logprob=-1.0)},
                                                             {4: SimpleNamespace(logprob=-1.0)}], finish_reason="stop")
    for broken, match in [(SimpleNamespace(token_ids=[1], logprobs=None, finish_reason="stop"), "row 0: .*logprobs=0"),
                          (_completion([1], [-1.0], "abort"), "row 0: .*abort"),
                          (wrong_token, "row 0, response position 1: no log-prob for the sampled token 3")]:
        with pytest.raises(ValueError, match=match):
            rollout_batch_from_outputs([SimpleNamespace(outputs=[broken])], torch.ones(1, 2, dtype=torch.long),
                                       torch.ones(1, 2, dtype=torch.bool), tokenizer, [2], vocab_size=len(tokenizer),
                                       max_new_tokens=4)


def _convert(tokenizer, outputs, *, max_new_tokens=4):
    ids = torch.ones(len(outputs), 2, dtype=torch.long)
    return rollout_batch_from_outputs(outputs, ids, ids > 0, tokenizer, [tokenizer.eos_token_id], vocab_size=VOCAB,
                                      max_new_tokens=max_new_tokens)


@pytest.mark.parametrize("bad_logprob", [float("nan"), float("inf"), float("-inf"), 0.25])
def test_non_finite_or_positive_logprob_is_refused_naming_row_position_and_engine(tokenizer, bad_logprob):
    # trl #6166: vLLM returned NaN for one token. Row 1, response position 2 is the bad entry; on main
    # it was accepted and the TIS weight, the loss and the gap metric became NaN.
    outputs = [_request([11, 12, 13], [-0.5, -1.0, -0.25], "length"),
               _request([14, 15, 16, 17], [-0.1, -0.2, bad_logprob, -0.3], "length")]
    with pytest.raises(ValueError, match=r"rollout engine 'vllm' returned log-prob .* token id 16 at row 1, "
                                         r"response position 2: .* finite and <= 0"):
        _convert(tokenizer, outputs)
    # A log-prob of exactly 0 (a certain token) is valid; values past the first stop id are never read.
    eos = tokenizer.eos_token_id
    ok = _convert(tokenizer, [_request([11, eos, 13], [0.0, -1.0, bad_logprob], "length")])
    assert ok.rollout_logprobs.tolist() == [[0.0, -1.0]]


@pytest.mark.parametrize("bad_id", [-1, VOCAB])
def test_token_id_outside_the_vocabulary_is_refused(tokenizer, bad_id):
    outputs = [_request([11, bad_id], [-0.5, -1.0], "length")]
    with pytest.raises(ValueError, match=rf"'vllm' returned token id {bad_id} at row 0, response position 1: "
                                         rf"outside the model's vocabulary \[0, {VOCAB}\)"):
        _convert(tokenizer, outputs)
    # The last valid row of a padded vocabulary (ids the tokenizer never decodes) passes.
    assert _convert(tokenizer, [_request([11, VOCAB - 1], [-0.5, -1.0], "length")]).response_ids.tolist() == [
        [11, VOCAB - 1]]


def test_response_over_the_length_cap_is_refused(tokenizer):
    outputs = [_request([11, 12], [-0.5, -1.0], "length"), _request([11, 12, 13], [-0.5, -1.0, -2.0], "length")]
    with pytest.raises(ValueError, match=r"'vllm' returned 3 tokens for row 1, more than max_new_tokens=2"):
        _convert(tokenizer, outputs, max_new_tokens=2)


class _FakeLLM:
    """Records ``generate`` requests, ``collective_rpc`` calls and prefix-cache resets, in order."""

    def __init__(self):
        self.requests = self.params = None
        self.calls = []

    def generate(self, requests, params, use_tqdm):
        self.requests, self.params = requests, params
        random.random(), np.random.rand(), torch.rand(1)  # as vLLM's build/sampling may: must not leak
        return [_request([21, 22], [-1.0, -2.0], "length") for _ in requests]

    def collective_rpc(self, method, kwargs):
        self.calls.append((method, [name for name, _ in kwargs["weights_iterator"]]))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache", None))

    def apply_model(self, fn):
        self.calls.append(("apply_model", fn.__name__))

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self):
        self.calls.append(("wake_up", None))


def test_engine_generates_per_row_seeds_and_keeps_the_global_rngs(monkeypatch, tokenizer):
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kwargs: kwargs))
    llm = _FakeLLM()
    engine = VLLMRolloutEngine(llm, tokenizer, vocab_size=VOCAB, max_new_tokens=2, temperature=1.0)
    states = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()
    batch = engine.generate(["a b", "a b c"], seed=7)
    assert random.getstate() == states[0] and (np.random.get_state()[1] == states[1]).all()
    assert torch.equal(torch.get_rng_state(), states[2])
    expected = [tokenizer("a b", add_special_tokens=False)["input_ids"],
                tokenizer("a b c", add_special_tokens=False)["input_ids"]]
    assert [r["prompt_token_ids"] for r in llm.requests] == expected  # unpadded ids, no special tokens
    assert [p["seed"] for p in llm.params] == [7, 8]
    # SmolLM2's stop list: <|im_end|> (its EOS, id 2) and <|endoftext|> (id 0).
    assert llm.params[0]["stop_token_ids"] == [0, 2] == engine.stop_token_ids
    assert batch.truncated.tolist() == [True, True] and batch.response_ids.shape == (2, 2)


def test_refit_reloads_whole_buckets_adds_the_tied_head_and_resets_the_prefix_cache(tokenizer):
    llm = _FakeLLM()
    engine = VLLMRolloutEngine(llm, tokenizer, vocab_size=VOCAB, max_new_tokens=2, temperature=1.0,
                               tied_embeddings=True)
    embed = torch.ones(3, 2)
    engine.load_weights({"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(2)})
    # On CPU the MoE experts are repacked after the reload (a no-op for this dense model), then the
    # prefix cache is reset.
    assert llm.calls == [("reload_weights", ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]),
                         ("apply_model", "_repack_cpu_moe_experts"), ("reset_prefix_cache", None)]
    llm.calls.clear()
    engine.load_weight_buckets(iter([{"model.layers.0.mlp.up_proj.weight": embed},
                                     {"model.norm.weight": torch.ones(2)}]))
    assert [c[0] for c in llm.calls] == ["reload_weights", "reload_weights", "apply_model", "reset_prefix_cache"]


def test_sleep_only_when_enabled_and_woken_before_refit(tokenizer):
    llm = _FakeLLM()
    VLLMRolloutEngine(llm, tokenizer, vocab_size=VOCAB, max_new_tokens=2, temperature=1.0).sleep()
    assert llm.calls == []  # sleep mode off (the CPU default): nothing
    engine = VLLMRolloutEngine(llm, tokenizer, vocab_size=VOCAB, max_new_tokens=2, temperature=1.0,
                               sleep_between_steps=True)
    engine.sleep()
    engine.load_weights({"model.norm.weight": torch.ones(2)})
    assert [c[0] for c in llm.calls] == ["sleep", "wake_up", "reload_weights", "apply_model", "reset_prefix_cache"]
    assert llm.calls[0] == ("sleep", 1)


def test_build_llm_settings_and_process_isolation(monkeypatch, tmp_path):
    built = {}
    original_set_num_threads = torch.set_num_threads

    class LLM:  # does what vLLM's in-process CPU engine does to its host process
        def __init__(self, **kwargs):
            built.update(kwargs, env_multiproc=os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"),
                         env_bind=os.environ.get("VLLM_CPU_OMP_THREADS_BIND"))
            random.seed(0), np.random.seed(0), torch.manual_seed(0)
            torch.set_num_threads = lambda n: None

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=LLM))
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    build_llm(tmp_path, seed=3, cpu_kv_cache_gib=0.5, gpu_memory_utilization=0.9)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.set_num_threads is original_set_num_threads
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    assert built == dict(model=str(tmp_path), tensor_parallel_size=1, dtype="float32", max_model_len=None,
                         enforce_eager=False, seed=3, generation_config="vllm", logprobs_mode="processed_logprobs",
                         kv_cache_memory_bytes=1 << 29, env_multiproc="0", env_bind="nobind")
    with pytest.raises(ValueError, match="rollout.engine.options.cpu_kv_cache_gib"):
        build_llm(tmp_path, seed=3, cpu_kv_cache_gib=0)


def test_preserve_process_state_restores_threads():
    threads = torch.get_num_threads()
    with preserve_process_state():
        torch.set_num_threads(max(1, threads % 2 + 1))
        random.seed(5)
    assert torch.get_num_threads() == threads


def test_missing_vllm_names_the_config_key(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(ValueError, match="rollout.engine.backend"):
        import_vllm()


def test_eval_engine_builds_through_build_llm_and_stops_at_the_stop_list(monkeypatch, tmp_path):
    from nemo_sspo.evaluation import VLLMEvalEngine

    built, sampled = {}, {}
    qwen = load_hf_checkpoint("tiny-random-qwen2")[2]

    class LLM:
        def __init__(self, **kwargs):
            built.update(kwargs)

        def get_tokenizer(self):
            return qwen

        def generate(self, prompts, params, use_tqdm):
            sampled.update(params.kwargs)
            return [SimpleNamespace(outputs=[SimpleNamespace(text=f"out:{p}")]) for p in prompts]

    class SamplingParams:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [151643, 7]}')
    engine = VLLMEvalEngine(tmp_path, tensor_parallel_size=2, gpu_memory_utilization=0.4, seed=3)
    assert engine.generate_greedy(["a", "b"], 3000) == ["out:a", "out:b"]
    assert built == dict(model=str(tmp_path), tensor_parallel_size=2, dtype="float32", max_model_len=None,
                         enforce_eager=False, seed=3, generation_config="vllm", kv_cache_memory_bytes=1 << 30)
    # greedy; the tokenizer's two end ids plus the folder's generation config's extra one
    assert sampled == dict(temperature=0.0, max_tokens=3000, stop_token_ids=[7, 151643, 151645])


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_adapters_are_refused_where_the_engine_cannot_serve_them(backend):
    # The hf engine takes weights only; with LoRA enabled vLLM's CPU build runs a Qwen3-MoE's experts
    # through Triton kernels (measured: vllm-cpu 0.32 fails in fused_moe/experts/triton_moe.py), so an
    # adapter refit is refused before any engine is built (at load too: test_lora_config.py).
    from nemo_sspo.rollout.engines import ROLLOUT_ENGINE_REGISTRY, EngineContext

    config, state_dict, tok = load_hf_checkpoint("tiny-random-qwen3-moe")
    context = EngineContext(hf_config=config, state_dict=state_dict, tokenizer=tok, model_source="tiny-random-qwen3-moe",
                            cache_dir=None, rollout=None, seed=0, device=torch.device("cpu"), stop_ids=[],
                            record_routes=False, output_layer_precision="auto", adapter_rank=4)
    message = {"hf": "the hf engine takes refitted weights only, not adapters; refit merged weights",
               "vllm": "adapter_rank=4: vLLM's CPU build cannot serve LoRA adapters on a mixture-of-experts model "
                       "(with LoRA enabled it runs the experts through Triton GPU kernels); refit merged weights on "
                       "this host"}[backend]
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        ROLLOUT_ENGINE_REGISTRY.build(backend, context)
