"""``model.lora``: its defaults, and every bad value refused at load naming the key and the fix (all
together, with the config's other problems); a mixture-of-experts model refused when the policy is
built, before anything is written."""

import pytest
import torch

from nemo_sspo.cli import load_config


def _problems(*overrides: str) -> str:
    with pytest.raises(ValueError) as err:
        load_config(overrides=list(overrides))
    return str(err.value)


def test_defaults_train_every_weight_and_target_every_linear_layer():
    lora = load_config().model.lora
    assert (lora.rank, lora.alpha, lora.dropout) == (0, 32.0, 0.0)
    assert [str(t) for t in lora.target] == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    chosen = load_config(overrides=["model.lora.rank=4", "model.lora.target=[linear_fc2,linear_qkv]"]).model.lora
    assert chosen.rank == 4 and [str(t) for t in chosen.target] == ["linear_fc2", "linear_qkv"]


def test_bad_values_are_refused_together_naming_each_key_and_fix():
    message = _problems("model.lora.rank=-1", "model.lora.alpha=0", "model.lora.dropout=1.0",
                        "model.lora.target=[linear_fc1,linear_fc1]")
    assert message.startswith("invalid config 'sspo_smollm2_cpu': 4 config problems:")
    assert "model.lora.rank=-1 must be >= 0 (0 = full fine-tuning, no adapters)" in message
    assert "model.lora.alpha=0.0 must be a finite number > 0 (the adapters' scale is alpha / rank)" in message
    assert "model.lora.dropout=1.0 must be in [0, 1)" in message
    assert "model.lora.target=['linear_fc1', 'linear_fc1'] names a layer twice; name each once" in message


def test_an_empty_or_unknown_target_is_refused_with_the_valid_names():
    assert ("model.lora.target is empty: name at least one of ['linear_qkv', 'linear_proj', 'linear_fc1', "
            "'linear_fc2'], or set model.lora.rank=0 for full fine-tuning") in _problems("model.lora.target=[]")
    message = _problems("model.lora.target=[q_proj]")
    assert "model.lora.target" in message and "q_proj" in message
    assert "linear_qkv, linear_proj, linear_fc1, linear_fc2" in message


def test_adapters_on_transformer_engine_layers_are_refused_at_load():
    message = _problems("model.lora.rank=4", "model.transformer_impl=transformer_engine")
    assert ("model.lora.rank=4 builds adapters on the local layer spec only so far, but "
            "model.transformer_impl='transformer_engine'; set model.transformer_impl=local") in message


def test_an_adapter_refit_needs_adapters_and_the_vllm_engine():
    expected = ("model.lora.refit='adapters' sends the adapters alone to a vLLM engine, but model.lora.rank={rank} "
                "and rollout.engine.backend={backend!r}; use model.lora.rank >= 1 with rollout/engine=vllm, or "
                "model.lora.refit=merged")
    assert expected.format(rank=4, backend="hf") in _problems("model.lora.rank=4", "model.lora.refit=adapters")
    assert expected.format(rank=0, backend="vllm") in _problems("model.lora.refit=adapters", "rollout/engine=vllm")
    cfg = load_config(overrides=["model.lora.rank=4", "model.lora.refit=adapters", "rollout/engine=vllm"])
    assert cfg.model.lora.refit == "adapters"


def test_an_adapter_refit_of_a_mixture_of_experts_model_is_refused_at_load_without_cuda():
    overrides = ["model=tiny_random_qwen3_moe", "model.lora.rank=4", "model.lora.refit=adapters", "rollout/engine=vllm"]
    if torch.cuda.is_available():  # vLLM's GPU build serves MoE LoRA: nothing to refuse
        assert load_config(overrides=overrides, check_model=True).model.lora.refit == "adapters"
        return
    with pytest.raises(ValueError) as err:
        load_config(overrides=overrides, check_model=True)
    assert ("model.lora.refit='adapters' with the mixture-of-experts model.source='tiny-random-qwen3-moe': vLLM's "
            "CPU build cannot serve LoRA adapters on it (with LoRA enabled it runs the experts through Triton GPU "
            "kernels); set model.lora.refit=merged on this host") in str(err.value)
