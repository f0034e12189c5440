"""Failures found when the config is loaded, before any weight is read: the layout facts of the
model's config.json, and Hydra type errors with OmegaConf's reason."""

import pytest
from transformers import LlamaConfig

from nemo_sspo.cli import load_config, main


@pytest.fixture
def config_only_model(tmp_path):
    """A model folder holding only config.json (no weights, no tokenizer): 6 heads, 2 key/value
    heads, 5 layers, 64 positions. Anything that tried to load the model would fail on it."""
    LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=5, num_attention_heads=6,
                num_key_value_heads=2, vocab_size=256, max_position_embeddings=64).save_pretrained(tmp_path)
    return str(tmp_path)


def _load(model_dir, overrides, world_size, monkeypatch, command="train"):
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    return load_config(overrides=[f"model.source={model_dir}", *overrides], command=command, check_model=True)


def test_a_layout_the_heads_allow_loads_without_weights(config_only_model, monkeypatch):
    cfg = _load(config_only_model, ["parallel.tensor_model_parallel_size=2"], 2, monkeypatch)
    assert cfg.parallel.tensor_model_parallel_size == 2


@pytest.mark.parametrize("overrides, world_size, message", [
    # gcd(6 heads, 2 KV heads) = 2: TP 1 or 2; TP 3 divides the 6 heads but not the 2 KV heads.
    (["parallel.tensor_model_parallel_size=3"], 3,
     r"parallel.tensor_model_parallel_size=3 does not divide the model's num_key_value_heads=2 .*use one of 1, 2$"),
    (["parallel.tensor_model_parallel_size=4"], 4,
     r"tensor_model_parallel_size=4 does not divide the model's num_attention_heads=6 .*use one of 1, 2$"),
    # 5 layers split over 1 or 5 stages only.
    (["parallel.pipeline_model_parallel_size=2"], 2,
     r"parallel.pipeline_model_parallel_size=2 does not divide the model's num_hidden_layers=5: use one of 1, 5$"),
    (["loss=sppo", "critic.num_layers=6"], 1, r"critic.num_layers=6 exceeds the 5 layers"),
    # vLLM shards the 6 query heads: 4 does not divide them.
    (["rollout/engine=vllm", "rollout.engine.options.tensor_parallel_size=4"], 1,
     r"rollout.engine.options.tensor_parallel_size=4 does not split the 6 heads / 2 key/value heads"),
    (["rollout/engine=vllm", "rollout.engine.options.max_model_len=128"], 1,
     r"rollout.engine.options.max_model_len=128 exceeds max_position_embeddings=64"),
    # the default 64 new tokens fill the whole 64-position context: no room for a prompt.
    (["rollout.engine.backend=vllm"], 1, r"rollout.sampling.max_new_tokens=64 leaves no room for a prompt in vLLM's context of 64"),
])
def test_layout_facts_of_config_json_are_refused_at_load(config_only_model, monkeypatch, overrides, world_size,
                                                         message):
    with pytest.raises(ValueError, match=message) as err:
        _load(config_only_model, overrides, world_size, monkeypatch)
    assert f"model.source={config_only_model!r}" in str(err.value)


def test_eval_checks_the_engine_layout_only(config_only_model, monkeypatch):
    """`nemo-sspo eval` builds no Megatron model: a trainer TP the heads refuse is not its concern."""
    cfg = _load(config_only_model, ["parallel.tensor_model_parallel_size=4"], 1, monkeypatch, command="eval")
    assert cfg.parallel.tensor_model_parallel_size == 4
    with pytest.raises(ValueError, match="rollout.engine.options.tensor_parallel_size=4 does not split"):
        _load(config_only_model, ["rollout/engine=vllm", "rollout.engine.options.tensor_parallel_size=4"], 1, monkeypatch,
              command="eval")


def test_cli_refuses_smollm2_at_tp2_before_loading_it(monkeypatch, capsys):
    """SmolLM2-135M has 9 heads / 3 key/value heads: TP=2 fails from its config alone (the weights
    loader is replaced by one that fails, so a late check would show up as another error)."""
    import nemo_sspo.models.hf_checkpoint as hf_checkpoint

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded before the layout was checked")

    monkeypatch.setattr(hf_checkpoint, "load_hf_checkpoint", no_weights)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", "parallel=tp2", "trainer.output_dir=/nonexistent/never-written"]) == 2
    assert ("parallel.tensor_model_parallel_size=2 does not divide the model's num_attention_heads=9 "
            "(heads 9, key/value heads 3): use one of 1, 3") in capsys.readouterr().err


@pytest.mark.parametrize("override, reason", [
    ("trainer.max_steps=two", "Value 'two' of type 'str' could not be converted to Integer"),
    ("rollout.sampling.temperature=hot", "Value 'hot' of type 'str' could not be converted to Float"),
    ("parallel.pack_sequences=maybe", "Value 'maybe' is not a valid bool (type str)"),
])
def test_hydra_type_error_keeps_omegaconf_reason(override, reason):
    with pytest.raises(ValueError) as err:
        load_config(overrides=[override])
    key, value = override.split("=")
    assert str(err.value) == f"invalid config 'sspo_smollm2_cpu': {key}='{value}': {reason}"


def test_moe_settings_are_refused_at_load(config_only_model, monkeypatch):
    # The tiny Qwen3-MoE (4 heads / 2 KV heads: TP 2 splits them) at TP 2: megatron-core raises on the
    # first training forward of an MoE layer under TP without sequence parallelism, so the load needs
    # it; with it the layout loads (tests/integration/test_moe_r3_loop.py trains it).
    with pytest.raises(ValueError, match=r"parallel.tensor_model_parallel_size=2 with the mixture-of-experts "
                                         r".* needs parallel.sequence_parallel=true"):
        _load("tiny-random-qwen3-moe", ["parallel.tensor_model_parallel_size=2"], 2, monkeypatch)
    _load("tiny-random-qwen3-moe", ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"], 2,
          monkeypatch)
    # Sequence parallelism splits the sequence over TP ranks: TP 1 has none to split over.
    with pytest.raises(ValueError, match=r"parallel.sequence_parallel=true needs parallel.tensor_model_parallel_size > 1"):
        _load(config_only_model, ["parallel.sequence_parallel=true"], 1, monkeypatch)
    # HF's load-balancing loss needs a router, a coefficient >= 0 and a single pipeline stage.
    with pytest.raises(ValueError, match=r"model.router_aux_loss_coef=0.001 needs a mixture-of-experts model"):
        _load(config_only_model, ["model.router_aux_loss_coef=0.001"], 1, monkeypatch)
    with pytest.raises(ValueError, match=r"model.router_aux_loss_coef=-0.1 must be >= 0"):
        _load("tiny-random-qwen3-moe", ["model.router_aux_loss_coef=-0.1"], 1, monkeypatch)
    with pytest.raises(ValueError, match=r"router_aux_loss_coef=0.001 needs parallel.pipeline_model_parallel_size=1"):
        _load("tiny-random-qwen3-moe", ["model.router_aux_loss_coef=0.001", "parallel.pipeline_model_parallel_size=2"],
              2, monkeypatch)
