"""Recipes for the seeds' other systems compose (Hydra, no GPU) into their papers' settings and fit
their stated GPU counts.

SPPO's values are its paper's 1.5B command (arXiv 2604.08865, appendix E.1): 256 prompts x 1
response per step in 2 optimizer steps (ppo_mini_batch_size 128), 8,192-token responses, rollout
temperature 0.6, policy lr 1e-6 with weight decay 0.01, critic lr 5e-6, 1,000 steps, evaluation every
10 steps, 4 GPUs. The Qwen3-8B recipe keeps the SSPO recipes' setting (all ours) at TP=4 x DP=2; the
Qwen3-30B-A3B recipe the same setting at TP=1 x DP=16 with EP=16 on 16 GPUs. ``--print-config`` prints
each rank's parameters from a meta-device build of the recipe's model (published architecture when
the checkpoint is not cached), checked here against hand counts.
"""

import huggingface_hub.constants
import pytest

from nemo_sspo.cli import load_config, main
from nemo_sspo.trainer.config import validate


def test_sppo_recipe_has_the_paper_setting_and_fits_4_gpus():
    cfg = load_config("sppo_deepseek_r1_distill_qwen_1.5b", command="eval")
    assert cfg.loss.name == "sppo" and cfg.model.source == "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
    ro = cfg.rollout
    assert (ro.prompts_per_step, ro.samples_per_prompt, ro.sampling.max_new_tokens, ro.sampling.temperature) == (256, 1, 8192, 0.6)
    assert cfg.trainer.minibatches_per_step == 2  # 256 / 128 responses per optimizer step
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.critic.optim.lr) == (1e-6, 0.01, 5e-6)
    assert (cfg.trainer.max_steps, cfg.eval.every_n_steps, cfg.data.template) == (1000, 10, "chat-cot")
    assert cfg.trainer.checkpoint_interval > 0  # periodic checkpoints in every GPU recipe
    validate(cfg, world_size=4)  # one 4-GPU node: TP=1 x DP=4


def test_soft_seq_po_qwen3_8b_recipe_fits_8_gpu_nodes():
    cfg = load_config("soft_seq_po_qwen3_8b", command="eval")
    assert cfg.loss.name == "soft_seq_po" and cfg.model.source == "Qwen/Qwen3-8B"
    assert (cfg.parallel.tensor_model_parallel_size, cfg.rollout.engine.options.tensor_parallel_size) == (4, 4)
    assert cfg.data.template == "chat-cot" and cfg.trainer.checkpoint_interval > 0
    # Qwen3-8B's 32 query / 8 key-value heads split evenly over TP=4.
    assert 32 % cfg.parallel.tensor_model_parallel_size == 0 and 8 % cfg.parallel.tensor_model_parallel_size == 0
    for nodes in (1, 2):
        validate(cfg, world_size=8 * nodes)
    with pytest.raises(ValueError, match="tensor_model_parallel_size"):
        validate(cfg, world_size=6)  # 6 GPUs do not hold whole TP=4 groups


def test_soft_seq_po_qwen3_30b_a3b_recipe_fits_two_8_gpu_nodes_with_ep16():
    cfg = load_config("soft_seq_po_qwen3_30b_a3b", command="eval")
    assert cfg.loss.name == "soft_seq_po" and cfg.model.source == "Qwen/Qwen3-30B-A3B"
    par = cfg.parallel
    # TP 1: the experts are split by EP over the replicas (TP > 1 would need parallel.sequence_parallel=true).
    assert (par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.expert_model_parallel_size) == (1, 1, 16)
    assert cfg.rollout.engine.options.tensor_parallel_size == 1 and cfg.data.template == "chat-cot"
    assert (cfg.model.router_replay, cfg.model.router_aux_loss_coef) == ("r2", 0.001)  # HF's coefficient
    assert cfg.trainer.output_dir == "outputs/soft_seq_po_qwen3_30b_a3b" and cfg.trainer.checkpoint_interval > 0
    validate(cfg, world_size=16)  # DP 16, EP 16 divides it and the 128 experts
    with pytest.raises(ValueError, match="expert_model_parallel_size"):
        validate(cfg, world_size=8)  # DP 8: EP 16 does not fit


def _printed_counts(capsys, monkeypatch, world_size: int, config_name: str, *overrides: str) -> str:
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    assert main(["train", "--print-config", "--config-name", config_name, *overrides]) == 0
    return capsys.readouterr().out.rsplit("\n# parameters per rank", 1)[1]


def test_print_config_counts_the_moe_recipe_per_rank(capsys, monkeypatch, tmp_path):
    # EP 16, by hand (published architecture): 8 of the 128 experts, 3*768*2048 = 4,718,592 each, in each
    # of 48 layers: 1,811,939,328; attention 48*18,874,368 = 905,969,664; embedding + untied head
    # 2*151,936*2048 = 622,329,856; norms and routers 48*(2*128 + 2*2048 + 128*2048) + 2048 = 12,793,856
    # -> 3,353,032,704 per rank (as many as one token activates: 8 experts per layer).
    # an empty HF cache (read by snapshot_download at call time): the published architecture counts
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    printed = _printed_counts(capsys, monkeypatch, 16, "soft_seq_po_qwen3_30b_a3b")
    assert "TP=1 x PP=1 x EP=16" in printed and "published architecture" in printed
    assert "pipeline stage 0: 3,353,032,704 on every rank (6.25 GiB of bf16 weights)" in printed  # 2 bytes each


def test_print_config_counts_the_dense_recipe_per_rank(capsys, monkeypatch):
    # DeepSeek-R1-Distill-Qwen-1.5B at TP 1, by hand: per layer q 1536*1536 + 1536, k and v 256*1536 + 256
    # each, o 1536*1536 -> 5,507,072; MLP 3*8960*1536 = 41,287,680; norms 2*1536 -> 46,797,824, x28 =
    # 1,310,339,072; untied embedding + head 2*151,936*1536 = 466,747,392; final norm 1536 -> 1,777,088,000
    # (the model card's 1.78B).
    printed = _printed_counts(capsys, monkeypatch, 4, "sppo_deepseek_r1_distill_qwen_1.5b")
    assert "pipeline stage 0: 1,777,088,000 on every rank" in printed


def test_print_config_says_when_it_cannot_count(capsys, monkeypatch, tmp_path):
    printed = _printed_counts(capsys, monkeypatch, 4, "sppo_deepseek_r1_distill_qwen_1.5b",
                              f"model.source={tmp_path}/absent")
    assert printed.startswith(": not counted, model.source has no config here")
    monkeypatch.setenv("WORLD_SIZE", "8")  # TP 8 does not split the 12 heads: a layout error, exit 2
    assert main(["train", "--print-config", "--config-name", "sppo_deepseek_r1_distill_qwen_1.5b",
                 "parallel.tensor_model_parallel_size=8"]) == 2
    assert "parallel.tensor_model_parallel_size=8 does not divide" in capsys.readouterr().err
