"""Qwen3 dense and Qwen3-MoE through the real vLLM CPU engine: it loads the folder we write for
``tiny-random-qwen3`` (head_dim 32, which vLLM's CPU attention supports; q/k norm weights redrawn
around 1) and ``tiny-random-qwen3-moe`` (its ``Qwen3MoeForCausalLM`` with CPU MoE kernels: 8 experts,
top-2, per-expert checkpoint names), its log-probs equal transformers' fp32 forward on the same
tokens, a streamed refit from a Megatron model (``iter_hf_weight_buckets``, one decoder layer, with
all its experts, per bucket) gives the log-probs of transformers on the moved weights, and a second
refit back to the initial weights gives theirs again. A mapping that dropped or swapped q_norm /
k_norm, expert names vLLM's loader did not map, experts renumbered on the way, or experts not
repacked for vLLM's CPU kernel after the reload (log-prob gap 0.55 without the repacking) leave the
log-probs off after a refit, far above the 1e-4 tolerance.
"""

import pytest
import torch

from nemo_sspo.models import build_hf_model, load_hf_checkpoint
from nemo_sspo.models.hf_checkpoint import engine_model_dir
from nemo_sspo.rollout import VLLMRolloutEngine
from nemo_sspo.rollout import VLLMOptions
from tests.vllm.test_vllm_backend import TEMPERATURE, _gap, megatron_buckets

PROMPTS = ["Let x = 2.\n\nThen 2x =", "Sam has 5 stamps. He buys 2 more."]


@pytest.fixture(scope="module", params=["tiny-random-qwen3", "tiny-random-qwen3-moe"])
def qwen3(request, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    config, state_dict, tokenizer = load_hf_checkpoint(request.param)
    engine = VLLMRolloutEngine.build(engine_model_dir(request.param, cache_dir=str(cache)), tokenizer,
                                     options=VLLMOptions(max_model_len=256, enforce_eager=True,
                                                            cpu_kv_cache_gib=1),
                                     seed=0, max_new_tokens=12, temperature=TEMPERATURE)
    yield config, state_dict, engine
    engine.shutdown()  # the MoE engine after the dense one sets up vLLM's groups again, its expert group included


def test_vllm_loads_our_qwen3_folder_and_refits_from_megatron(qwen3):
    config, state_dict, engine = qwen3
    assert _gap(engine, build_hf_model(config, state_dict), PROMPTS, seed=3) < 1e-4
    generator = torch.Generator().manual_seed(5)
    moved = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in state_dict.items()}
    reference = build_hf_model(config, moved)
    assert _gap(engine, reference, PROMPTS, seed=3) > 1e-2  # the engine still holds the initial weights: the check can fail
    buckets = megatron_buckets(config, moved)
    engine.load_weight_buckets(iter(buckets))
    assert len(buckets) == config.num_hidden_layers + 2
    assert _gap(engine, reference, PROMPTS, seed=3) < 1e-4
    engine.load_weight_buckets(iter([state_dict]))  # back to the initial weights (MoE: repacked again)
    assert _gap(engine, build_hf_model(config, state_dict), PROMPTS, seed=3) < 1e-4
