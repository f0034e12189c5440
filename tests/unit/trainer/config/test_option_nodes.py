"""``reward.options`` and ``rollout.engine.options`` are typed by the options dataclass a reward / engine
was registered with: selected as a group (``reward=<name>``, ``rollout/engine=<name>``), filled with the
dataclass's defaults where a config names the builder without its group, refused when of another type,
and checked by the dataclass's own ``problems`` under the full key path."""

import shutil
from dataclasses import dataclass

import pytest

from nemo_sspo.cli import DEFAULT_CONFIG_DIR, load_config
from nemo_sspo.rewards import MathVerifyOptions, register_reward, reward_names, unregister_reward
from nemo_sspo.rollout import VLLMOptions, register_rollout_engine, rollout_engine_names, unregister_rollout_engine
from nemo_sspo.trainer.config import EngineConfig, RewardConfig, register_config_nodes


@dataclass
class TolerantOptions:
    """A plug-in reward's options."""

    tolerance: float = 0.0
    cap: int = 3

    def problems(self, key: str) -> list[str]:
        return [f"{key}.tolerance must be >= 0"] if self.tolerance < 0 else []


@pytest.fixture
def plugin_rewards():
    """``tolerant`` (typed by TolerantOptions) and ``untyped`` (registered without options)."""
    register_reward("tolerant", lambda section: None, options=TolerantOptions)
    register_reward("untyped", lambda section: None)
    register_config_nodes()
    yield
    unregister_reward("tolerant")
    unregister_reward("untyped")
    register_config_nodes()


@dataclass
class OffsetOptions:
    """A plug-in engine's options."""

    seed_offset: int = 0


@pytest.fixture
def plugin_engine():
    """``offset`` (typed by OffsetOptions)."""
    register_rollout_engine("offset", lambda context: None, options=OffsetOptions)
    register_config_nodes()
    yield
    unregister_rollout_engine("offset")
    register_config_nodes()


def test_a_plugin_engine_with_an_options_dataclass_is_a_group_until_unregistered(plugin_engine):
    engine = load_config(overrides=["rollout/engine=offset", "rollout.engine.options.seed_offset=7"]).rollout.engine
    assert engine == EngineConfig(backend="offset", options=OffsetOptions(seed_offset=7))
    unregister_rollout_engine("offset")
    try:
        with pytest.raises(ValueError, match=r"rollout/engine=offset is not a registered rollout engine; registered: \[(?!.*'offset')"):
            load_config(overrides=["rollout/engine=offset"])
    finally:
        register_rollout_engine("offset", lambda context: None, options=OffsetOptions)


def test_math_verify_is_the_default_group_and_a_field_is_set_without_plus():
    assert load_config(overrides=["reward.options.num_workers=4"]).reward == RewardConfig(
        name="math_verify", options=MathVerifyOptions(num_workers=4, timeout_s=5.0))


def test_the_vllm_group_gives_its_options_with_one_set_and_the_others_at_their_defaults():
    engine = load_config(overrides=["rollout/engine=vllm", "rollout.engine.options.max_model_len=512"]).rollout.engine
    assert engine == EngineConfig(backend="vllm", options=VLLMOptions(
        tensor_parallel_size=1, gpu_memory_utilization=0.5, cpu_kv_cache_gib=1.0, dtype="auto", max_model_len=512,
        enforce_eager=False, enable_sleep_mode=False))


def test_the_hf_group_has_no_options():
    assert load_config(overrides=["rollout/engine=vllm", "rollout/engine=hf"]).rollout.engine == EngineConfig(
        backend="hf", options=None)


def test_a_recipe_sets_the_vllm_and_math_verify_options_and_naming_hf_drops_the_vllm_ones():
    recipe = load_config("sspo_qwen2.5_math_7b", command="eval")  # vllm with TP 2 at 0.35 of the GPU
    assert (recipe.rollout.engine.options.tensor_parallel_size, recipe.rollout.engine.options.gpu_memory_utilization,
            recipe.reward.options) == (2, 0.35, MathVerifyOptions(num_workers=8, timeout_s=5.0))
    # The recipe's vLLM settings, which hf never reads (as before they moved into options): dropped.
    hf = load_config("sspo_qwen2.5_math_7b", ["model=tiny_random_qwen2", "rollout.engine.backend=hf"], command="eval")
    assert hf.rollout.engine == EngineConfig(backend="hf", options=None)


def test_naming_vllm_without_its_group_gets_its_defaults():
    assert load_config(overrides=["rollout.engine.backend=vllm"]).rollout.engine.options == VLLMOptions()


def test_a_users_yaml_without_the_groups_keeps_its_meaning(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(DEFAULT_CONFIG_DIR, conf)
    (conf / "mine.yaml").write_text(
        "defaults:\n  - train_schema\n  - model: smollm2_135m\n  - data: word_problems\n  - parallel: single\n"
        "  - loss: sspo\n  - _self_\nreward:\n  name: math_verify\nrollout:\n  engine:\n    backend: vllm\n")
    cfg = load_config("mine", config_dir=conf)
    assert (cfg.reward.options, cfg.rollout.engine.options) == (MathVerifyOptions(2, 5.0), VLLMOptions())


def test_a_plugin_reward_with_an_options_dataclass_is_a_group(plugin_rewards):
    cfg = load_config(overrides=["reward=tolerant", "reward.options.tolerance=0.25"])
    assert cfg.reward == RewardConfig(name="tolerant", options=TolerantOptions(tolerance=0.25, cap=3))
    # Its own check, under the full key path.
    with pytest.raises(ValueError, match=r"^invalid config 'sspo_smollm2_cpu': reward\.options\.tolerance must be >= 0$"):
        load_config(overrides=["reward=tolerant", "reward.options.tolerance=-1"])


def test_a_node_is_gone_once_its_reward_is_unregistered(plugin_rewards):
    unregister_reward("tolerant")
    try:
        with pytest.raises(ValueError, match=r"reward=tolerant is not a registered reward; registered: \[(?!.*'tolerant')"):
            load_config(overrides=["reward=tolerant"])
    finally:
        register_reward("tolerant", lambda section: None, options=TolerantOptions)


def test_renaming_a_groups_untouched_options_gives_the_named_rewards(plugin_rewards):
    # reward: math_verify selected, nothing set: the named reward's defaults (typed) or null (untyped).
    assert load_config(overrides=["reward.name=tolerant"]).reward.options == TolerantOptions(0.0, 3)
    assert load_config(overrides=["reward.name=untyped"]).reward.options is None


def test_a_recipes_math_verify_options_are_dropped_for_a_reward_without_options(plugin_rewards):
    # A recipe's set math_verify options were never read by a reward without options: dropped, as before.
    assert load_config("sspo_qwen2.5_math_7b", ["reward.name=untyped"], command="eval").reward.options is None


def test_options_set_for_another_reward_are_refused_naming_the_group(plugin_rewards):
    with pytest.raises(ValueError) as err:
        load_config(overrides=["reward=tolerant", "reward.options.tolerance=0.25", "reward.name=math_verify"])
    assert str(err.value) == (
        "invalid config 'sspo_smollm2_cpu': reward.name='math_verify' needs reward.options of type MathVerifyOptions, got TolerantOptions: select the "
        "reward as a group (reward=math_verify) instead of setting reward.name, then set its fields "
        "(reward.options.<field>=...)")


def test_a_mapping_for_a_typed_builder_and_a_dataclass_for_an_untyped_one_are_refused(plugin_rewards):
    assert RewardConfig(name="math_verify", options={"num_workers": 4}).problems("reward") == [
        "reward.name='math_verify' needs reward.options of type MathVerifyOptions, got dict: select the reward "
        "as a group (reward=math_verify) instead of setting reward.name, then set its fields "
        "(reward.options.<field>=...)"]
    assert RewardConfig(name="untyped", options={"anything": 1}).problems("reward") == []
    assert EngineConfig(backend="hf", options=TolerantOptions()).problems("rollout.engine") == [
        "rollout.engine.backend='hf' takes rollout.engine.options as a mapping or null (it was registered without "
        "an options dataclass), got TolerantOptions: select the engine as a group (rollout/engine=hf) instead of "
        "setting rollout.engine.backend, then set its fields (rollout.engine.options.<field>=...)"]


@pytest.mark.parametrize("overrides, message", [
    (["reward.options.num_workers=0"], "reward.options.num_workers must be >= 1"),
    (["reward.options.timeout_s=0"], "reward.options.timeout_s must be > 0 (seconds per answer)"),
    (["rollout/engine=vllm", "rollout.engine.options.gpu_memory_utilization=1.5"],
     "rollout.engine.options.gpu_memory_utilization must be in (0, 1]"),
    (["rollout/engine=vllm", "rollout.engine.options.dtype=float8"],
     "rollout.engine.options.dtype='float8' is unknown; valid: auto, float32, float, bfloat16, float16, half"),
    (["rollout/engine=vllm", "rollout.engine.options.max_model_len=-5"],
     "rollout.engine.options.max_model_len=-5 must be >= 1 (tokens), or null for the model's max_position_embeddings"),
])
def test_a_bad_option_is_reported_with_its_key_path(overrides, message):
    with pytest.raises(ValueError) as err:
        load_config(overrides=overrides)
    assert str(err.value) == f"invalid config 'sspo_smollm2_cpu': {message}"


def test_an_option_of_an_unselected_engine_names_the_group_to_select():
    with pytest.raises(ValueError) as err:
        load_config(overrides=["rollout.engine.backend=vllm", "rollout.engine.options.max_model_len=512"])
    assert str(err.value) == (
        "invalid config 'sspo_smollm2_cpu': rollout.engine.options.max_model_len: rollout.engine.options has no "
        "key 'max_model_len' until an engine that has it is selected as a group: rollout/engine=vllm (e.g. "
        "rollout/engine=vllm rollout.engine.options.max_model_len=...; a config whose defaults list does not "
        "select a rollout/engine group adds it with +rollout/engine=vllm); setting rollout.engine.backend alone "
        "gives the options' defaults")


@pytest.mark.parametrize("override, message", [
    ("reward=nope", "reward=nope is not a registered reward; registered: {}"),
    ("rollout/engine=nope", "rollout/engine=nope is not a registered rollout engine; registered: {}"),
])
def test_an_unknown_group_choice_lists_the_registered_ones(override, message):
    # Other tests' plug-ins may stay registered (modules imported once): the lists are the registries'.
    names = reward_names() if override.startswith("reward") else rollout_engine_names()
    assert {"math_verify"} <= set(names) if override.startswith("reward") else {"hf", "vllm"} <= set(names)
    message = message.format(names)
    with pytest.raises(ValueError) as err:
        load_config(overrides=[override])
    assert str(err.value) == (f"invalid config 'sspo_smollm2_cpu': {message} (a module that registers one is "
                              "loaded with the config key plugins)")
