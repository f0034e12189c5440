"""The one name -> entry table behind every plug-in point (nemo_sspo.registry)."""

from dataclasses import dataclass

import pytest

from nemo_sspo.algorithms.losses import get_soft_gate
from nemo_sspo.registry import PLUGINS_HINT, BuilderRegistry, Registry
from nemo_sspo.rewards import reward_names
from nemo_sspo.rollout import rollout_engine_names
from nemo_sspo.trainer.config import at_key


def test_add_get_remove_and_sorted_names():
    table: Registry[int] = Registry("widget")
    assert table.add("b", 2) == 2
    table.add("a", 1)
    assert table.names() == ["a", "b"]
    assert table.items() == [("a", 1), ("b", 2)]
    assert table.get("b") == 2
    assert "a" in table and "c" not in table
    assert table.remove("a") == 1
    assert table.names() == ["b"]


def test_a_taken_name_is_refused_and_the_first_entry_kept():
    table: Registry[int] = Registry("widget")
    table.add("a", 1)
    with pytest.raises(ValueError, match="widget 'a' is already registered; pick another name"):
        table.add("a", 2)
    assert table.get("a") == 1


def test_unknown_names_name_the_argument_and_list_the_registered_ones():
    table: Registry[int] = Registry("widget", key="kind", hint=" (load a plug-in)")
    table.add("a", 1)
    message = r"kind='z' is not a registered widget; registered: \['a'\] \(load a plug-in\)"
    with pytest.raises(ValueError, match=message):
        table.get("z")
    with pytest.raises(ValueError, match=message):
        table.remove("z")
    with pytest.raises(ValueError, match=r"^section\." + message):
        at_key("section.", lambda: table.get("z"))


def test_the_package_plug_in_points_use_it():
    assert {"hf", "vllm"} <= set(rollout_engine_names())
    assert "math_verify" in reward_names()
    with pytest.raises(ValueError, match="gate='nope' is not a registered soft gate"):
        get_soft_gate("nope")


def test_a_builder_registry_calls_the_named_builder_and_names_the_plugins_key():
    table: BuilderRegistry[int, int] = BuilderRegistry("widget", key="kind")
    table.add("double", lambda n: 2 * n)
    assert table.build("double", 21) == 42
    message = r"kind='z' is not a registered widget; registered: \['double'\] \(a module that registers one"
    with pytest.raises(ValueError, match=message):
        table.build("z", 1)
    assert PLUGINS_HINT.endswith("loaded with the config key plugins)")


def test_a_builder_may_declare_an_options_dataclass():
    @dataclass
    class Options:
        size: int = 1

    table: BuilderRegistry[int, int] = BuilderRegistry("widget", key="kind")
    table.add("typed", lambda n: n, options=Options)
    table.add("plain", lambda n: n)
    assert (table.options_of("typed"), table.options_of("plain")) == (Options, None)
    assert table.declared_options() == {"typed": Options}
    with pytest.raises(TypeError, match=r"options=\{'size': 1\} of widget 'bad' must be a dataclass type"):
        table.add("bad", lambda n: n, options={"size": 1})
    assert "bad" not in table
    table.remove("typed")
    assert table.declared_options() == {}
    with pytest.raises(ValueError, match="kind='typed' is not a registered widget"):
        table.options_of("typed")


def test_math_verify_and_vllm_declare_their_options_and_hf_none():
    from nemo_sspo import rewards, rollout

    assert rewards.REWARD_REGISTRY.options_of("math_verify") is rewards.MathVerifyOptions
    assert rollout.ROLLOUT_ENGINE_REGISTRY.declared_options() == {"vllm": rollout.VLLMOptions}


def test_the_reward_and_engine_functions_are_their_registries_methods():
    # One copy of the rules: each public name is bound to its registry (no wrapper to drift).
    from nemo_sspo import rewards, rollout

    assert rewards.register_reward.__self__ is rewards.REWARD_REGISTRY
    assert rollout.build_rollout_engine.__self__ is rollout.ROLLOUT_ENGINE_REGISTRY
    with pytest.raises(ValueError, match=r"^backend='nope' is not a registered rollout engine; registered: \["):
        rollout.build_rollout_engine("nope", None)
    with pytest.raises(ValueError, match=r"^name='nope' is not a registered reward; registered: \["):
        rewards.build_reward("nope", None)
