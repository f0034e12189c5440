"""The Qwen2.5-Math recipes compose (Hydra, no GPU) into the paper's settings and valid layouts."""

import copy
from functools import lru_cache
from pathlib import Path

import pytest

from nemo_sspo.cli import DEFAULT_CONFIG_DIR, load_config
from nemo_sspo.trainer.config import validate

RECIPES = sorted(p.stem for p in Path(DEFAULT_CONFIG_DIR).glob("*_qwen2.5_math_*.yaml") if not p.stem.endswith("_lora"))
# The paper's entropy-adaptive clip bounds per model size (eq. 14/15).
SSPO_BOUNDS = {"1.5b": {"alpha": 0.0, "beta": 0.8, "gamma": 1.75}, "7b": {"alpha": 0.1, "beta": 0.8, "gamma": 2.2}}


@lru_cache(maxsize=None)
def _composed(name: str):
    return load_config(name, command="eval")  # layout checked per test at 8-GPU world sizes


def _recipe(name: str):
    """A private copy of the composed recipe (composing costs ~0.2 s; tests share one per name)."""
    return copy.deepcopy(_composed(name))


def test_every_loss_has_a_recipe_per_size():
    assert RECIPES == sorted(f"{loss}_qwen2.5_math_{size}" for loss in ("sspo", "grpo", "gspo")
                             for size in ("1.5b", "7b"))


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_has_the_paper_setting(name):
    loss, size = name.split("_")[0], name.rsplit("_", 1)[1]
    cfg = _recipe(name)
    ro = cfg.rollout
    assert (ro.samples_per_prompt, ro.sampling.max_new_tokens, ro.prompts_per_step) == (8, 3000, 128)
    assert (ro.sampling.temperature, ro.sampling.top_p, ro.engine.backend) == (1.0, 1.0, "vllm")  # unbiased rollout log-probs
    assert (cfg.data.source, cfg.data.options.dataset, cfg.data.template) == ("math", "math_train", "qwen-math")
    assert cfg.eval.every_n_steps == 10 and cfg.eval.max_new_tokens == 3000
    assert cfg.model.source == f"Qwen/Qwen2.5-Math-{size.upper()[:-1]}B" and cfg.model.precision == "bf16"
    assert cfg.loss.name == loss and cfg.trainer.output_dir == f"outputs/{name}"
    # periodic resumable checkpoints at every evaluation, continued by rerunning the same command
    tr = cfg.trainer
    assert (tr.checkpoint_interval, tr.keep_checkpoints, tr.resume) == (10, 2, "auto")
    if loss == "sspo":
        assert {k: getattr(cfg.loss.params, k) for k in ("alpha", "beta", "gamma")} == SSPO_BOUNDS[size]
    else:  # a baseline shares everything but the loss
        base = _recipe(f"sspo_qwen2.5_math_{size}")
        for section in ("model", "data", "rollout", "optim", "parallel", "eval", "reward"):
            assert getattr(cfg, section) == getattr(base, section), section


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("nodes", [1, 2])
def test_recipe_layout_fits_8_gpu_nodes(name, nodes):
    cfg = _recipe(name)
    validate(cfg, world_size=8 * nodes)  # whole prompt groups per DP rank, whole micro-batches
    tp = cfg.parallel.tensor_model_parallel_size
    assert 8 % tp == 0 and cfg.rollout.engine.options.tensor_parallel_size == tp  # a replica's GPUs serve its vLLM


def test_recipe_accepts_a_local_model_directory_and_tiny_model():
    cfg = load_config("sspo_qwen2.5_math_7b", ["model.source=/models/Qwen2.5-Math-7B"], command="eval")
    assert cfg.model.source == "/models/Qwen2.5-Math-7B" and cfg.parallel.tensor_model_parallel_size == 2
    tiny = load_config("sspo_qwen2.5_math_7b", ["model=tiny_random_qwen2", "rollout.engine.backend=hf"], command="eval")
    assert tiny.model.source == "tiny-random-qwen2" and tiny.loss.params.gamma == 2.2


@pytest.mark.parametrize("size", ["1.5b", "7b"])
@pytest.mark.parametrize("loss", ["grpo", "dapo", "sspo_fixed_clip"])
def test_sspo_recipe_switches_loss_on_the_command_line(size, loss):
    """`loss=<name>` replaces the whole loss group: no SSPO bound is left behind for another loss."""
    cfg = load_config(f"sspo_qwen2.5_math_{size}", [f"loss={loss}"], command="eval")
    assert cfg.loss.name == loss and not hasattr(cfg.loss.params, "gamma")
    validate(cfg, world_size=8)


# Every shipped GPU recipe, the world size and the GPUs (GiB) its comment names: one 8-GPU H100 / H200
# node for the Qwen2.5-Math and Qwen3-8B recipes, one 4-GPU 80 GB node for SPPO, two 8-GPU H200 nodes
# for Qwen3-30B-A3B (H100 80 GB = 79.65 GiB would be tighter than 80; we take the nominal 80).
GPU_RECIPES = [(name, 8, (80, 141)) for name in RECIPES] + [
    ("soft_seq_po_qwen3_8b", 8, (80, 141)), ("sppo_deepseek_r1_distill_qwen_1.5b", 4, (80, 141)),
    ("soft_seq_po_qwen3_30b_a3b", 16, (141,)), ("sspo_qwen2.5_math_7b_lora", 1, (80, 141)),
    ("soft_seq_po_qwen3_30b_a3b_lora", 2, (141,))]

# LoRA recipe -> what it changes in its full recipe (rank 32, local layers with selective recomputation,
# 10x the learning rate after LoRA Without Regret, fewer GPUs)
LORA_CHANGES = {
    "sspo_qwen2.5_math_7b": {
        "parallel.tensor_model_parallel_size": (2, 1),
        "rollout.engine.options.tensor_parallel_size": (2, 1),
        "rollout.engine.options.gpu_memory_utilization": (0.35, 0.4)},
    "soft_seq_po_qwen3_30b_a3b": {"parallel.expert_model_parallel_size": (16, 2)},
}


@pytest.mark.parametrize("full_name", LORA_CHANGES)
def test_a_lora_recipe_is_its_full_recipe_with_adapters(full_name):
    from nemo_sspo.trainer.run_config import composed_config

    def flat(tree, prefix=""):
        return {k: v for key, value in tree.items()
                for k, v in (flat(value, f"{prefix}{key}.").items() if isinstance(value, dict) else {
                    f"{prefix}{key}": value}.items())}

    full, lora = (flat(composed_config(_recipe(name))) for name in (full_name, f"{full_name}_lora"))
    changed = {key: (full[key], lora[key]) for key in full if full[key] != lora[key]}
    assert changed == LORA_CHANGES[full_name] | {
        "model.transformer_impl": ("auto", "local"), "model.lora.rank": (0, 32),
        "parallel.recompute": ("none", "selective"), "optim.lr": (1e-6, 1e-5),
        "trainer.output_dir": (f"outputs/{full_name}", f"outputs/{full_name}_lora")}
    assert lora["model.lora.target"] == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def test_the_30b_lora_recipe_needs_its_two_gpus():
    # the fewest GPUs: on one (EP 1) the whole frozen model (59.25 GiB) and vLLM's half of the GPU leave no room
    from nemo_sspo.models.published import published_config
    from nemo_sspo.trainer.memory_plan import GIB, memory_plan

    cfg = _recipe("soft_seq_po_qwen3_30b_a3b_lora")
    cfg.parallel.expert_model_parallel_size = 1
    validate(cfg, world_size=1)
    assert memory_plan(cfg, published_config(cfg.model.source), world_size=1, gpu_gib=141).peak > 141 * GIB


def test_every_gpu_recipe_is_planned():
    shipped = {p.stem for p in Path(DEFAULT_CONFIG_DIR).glob("*.yaml")} - {"sspo_smollm2_cpu"}
    assert {name for name, _, _ in GPU_RECIPES} == shipped


@pytest.mark.parametrize("name,world_size,gpus", GPU_RECIPES)
def test_recipe_fits_its_gpus_with_10_percent_headroom(name, world_size, gpus):
    from nemo_sspo.models.published import published_config
    from nemo_sspo.trainer.memory_plan import GIB, memory_plan

    cfg = _recipe(name)
    validate(cfg, world_size=world_size)
    for gib in gpus:
        plan = memory_plan(cfg, published_config(cfg.model.source), world_size=world_size, gpu_gib=gib)
        assert plan.peak <= 0.9 * gib * GIB, (name, gib, plan.peak / GIB)
