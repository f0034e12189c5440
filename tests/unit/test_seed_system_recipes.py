"""Recipes for the seeds' other systems compose (Hydra, no GPU) into their papers' settings and fit
their stated GPU counts.

SPPO's values are its paper's 1.5B command (arXiv 2604.08865, appendix E.1): 256 prompts x 1
response per step in 2 optimizer steps (ppo_mini_batch_size 128), 8,192-token responses, rollout
temperature 0.6, policy lr 1e-6 with weight decay 0.01, critic lr 5e-6, 1,000 steps, evaluation every
10 steps, 4 GPUs. The Qwen3-8B recipe keeps the SSPO recipes' setting (all ours) at TP=4 x DP=2.
"""

import pytest

from nemo_sspo.cli import load_config
from nemo_sspo.trainer.config import validate


def test_sppo_recipe_has_the_paper_setting_and_fits_4_gpus():
    cfg = load_config("sppo_deepseek_r1_distill_qwen_1.5b", command="eval")
    assert cfg.loss.name == "sppo" and cfg.model.source == "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
    ro = cfg.rollout
    assert (ro.prompts_per_step, ro.samples_per_prompt, ro.max_new_tokens, ro.temperature) == (256, 1, 8192, 0.6)
    assert cfg.trainer.minibatches_per_step == 2  # 256 / 128 responses per optimizer step
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.critic.optim.lr) == (1e-6, 0.01, 5e-6)
    assert (cfg.trainer.max_steps, cfg.eval.every_n_steps, cfg.data.template) == (1000, 10, "chat-cot")
    assert cfg.trainer.checkpoint_interval > 0  # periodic checkpoints in every GPU recipe
    validate(cfg, world_size=4)  # one 4-GPU node: TP=1 x DP=4


def test_soft_seq_po_qwen3_8b_recipe_fits_8_gpu_nodes():
    cfg = load_config("soft_seq_po_qwen3_8b", command="eval")
    assert cfg.loss.name == "soft_seq_po" and cfg.model.source == "Qwen/Qwen3-8B"
    assert (cfg.parallel.tensor_model_parallel_size, cfg.rollout.vllm.tensor_parallel_size) == (4, 4)
    assert cfg.data.template == "chat-cot" and cfg.trainer.checkpoint_interval > 0
    # Qwen3-8B's 32 query / 8 key-value heads split evenly over TP=4.
    assert 32 % cfg.parallel.tensor_model_parallel_size == 0 and 8 % cfg.parallel.tensor_model_parallel_size == 0
    for nodes in (1, 2):
        validate(cfg, world_size=8 * nodes)
    with pytest.raises(ValueError, match="tensor_model_parallel_size"):
        validate(cfg, world_size=6)  # 6 GPUs do not hold whole TP=4 groups
