"""The Qwen2.5-Math recipes compose (Hydra, no GPU) into the paper's settings and valid layouts."""

import copy
from functools import lru_cache
from pathlib import Path

import pytest

from nemo_sspo.cli import DEFAULT_CONFIG_DIR, load_config
from nemo_sspo.trainer.config import validate

RECIPES = sorted(p.stem for p in Path(DEFAULT_CONFIG_DIR).glob("*_qwen2.5_math_*.yaml"))
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
    assert (ro.samples_per_prompt, ro.max_new_tokens, ro.prompts_per_step) == (8, 3000, 128)
    assert (ro.temperature, ro.top_p, ro.backend) == (1.0, 1.0, "vllm")  # unbiased rollout log-probs
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
    assert 8 % tp == 0 and cfg.rollout.vllm.tensor_parallel_size == tp  # a replica's GPUs serve its vLLM


def test_recipe_accepts_a_local_model_directory_and_tiny_model():
    cfg = load_config("sspo_qwen2.5_math_7b", ["model.source=/models/Qwen2.5-Math-7B"], command="eval")
    assert cfg.model.source == "/models/Qwen2.5-Math-7B" and cfg.parallel.tensor_model_parallel_size == 2
    tiny = load_config("sspo_qwen2.5_math_7b", ["model=tiny_random_qwen2", "rollout.backend=hf"], command="eval")
    assert tiny.model.source == "tiny-random-qwen2" and tiny.loss.params.gamma == 2.2


@pytest.mark.parametrize("size", ["1.5b", "7b"])
@pytest.mark.parametrize("loss", ["grpo", "dapo", "sspo_fixed_clip"])
def test_sspo_recipe_switches_loss_on_the_command_line(size, loss):
    """`loss=<name>` replaces the whole loss group: no SSPO bound is left behind for another loss."""
    cfg = load_config(f"sspo_qwen2.5_math_{size}", [f"loss={loss}"], command="eval")
    assert cfg.loss.name == loss and not hasattr(cfg.loss.params, "gamma")
    validate(cfg, world_size=8)
