"""The keys of earlier releases (the advantage keys, the flat ``rollout`` section's keys, the vllm engine's
and math_verify's settings before they moved into ``options``) are refused at load naming the new key,
and a saved ``config.yaml`` of an earlier release is read in today's layout (resume)."""

import shutil
from dataclasses import asdict

import pytest

from nemo_sspo.cli import DEFAULT_CONFIG_DIR, load_config
from nemo_sspo.rollout import VLLMOptions
from nemo_sspo.trainer.config import upgrade_saved_config
from nemo_sspo.trainer.run_config import (
    composed_config,
    data_parallel_size,
    read_config,
    resume_changes,
    resume_mismatches,
)


@pytest.mark.parametrize("override, message", [
    ("loss.params.smooth_advantages=true",
     "loss.params.smooth_advantages was removed: DCPO's smooth standardisation is the advantage estimator "
     "dcpo_smooth: use advantage.name=dcpo_smooth (true), or leave advantage.name out (false)"),
    ("loss.params.advantage_std_normalisation=false",
     "loss.params.advantage_std_normalisation was removed: the std switch is advantage.normalize_std: use "
     "advantage.normalize_std=true or false (null = the loss's default)"),
])
def test_an_old_override_is_refused_naming_the_new_key(override, message):
    with pytest.raises(ValueError) as err:
        load_config(overrides=["loss=dcpo", override])
    assert str(err.value) == f"invalid config 'sspo_smollm2_cpu': {message}"


def test_an_old_key_in_a_yaml_file_is_refused_naming_the_new_key(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(DEFAULT_CONFIG_DIR, conf)
    (conf / "old.yaml").write_text("defaults:\n  - sspo_smollm2_cpu\n  - override loss: dcpo\n  - _self_\n"
                                   "loss:\n  params:\n    advantage_std_normalisation: false\n")
    with pytest.raises(ValueError) as err:
        load_config("old", config_dir=conf)
    assert str(err.value) == (
        "invalid config 'old': loss.params.advantage_std_normalisation was removed: the std switch is "
        "advantage.normalize_std: use advantage.normalize_std=true or false (null = the loss's default)")


def test_a_saved_config_of_an_earlier_release_reads_in_todays_layout(tmp_path):
    (tmp_path / "config.yaml").write_text(
        "loss:\n  name: dcpo\n  params:\n    eps_low: 0.2\n    smooth_advantages: true\n"
        "    advantage_std_normalisation: true\nadvantage:\n  name: group\n")
    assert read_config(tmp_path) == {"loss": {"name": "dcpo", "params": {"eps_low": 0.2}},
                                     "advantage": {"name": "dcpo_smooth", "normalize_std": None}}


def test_a_std_switch_off_its_losss_default_keeps_its_value():
    saved = {"loss": {"name": "grpo", "params": {"advantage_std_normalisation": False,
                                                 "smooth_advantages": False}},
             "advantage": {"name": "group"}}
    assert upgrade_saved_config(saved) == {"loss": {"name": "grpo", "params": {}},
                                           "advantage": {"name": "group", "normalize_std": False}}
    assert saved["loss"]["params"] == {"advantage_std_normalisation": False, "smooth_advantages": False}


def test_resuming_an_earlier_releases_dcpo_smooth_run_lists_no_advantage_change():
    saved = upgrade_saved_config({"loss": {"name": "dcpo", "params": {"smooth_advantages": True,
                                                                      "advantage_std_normalisation": True}},
                                  "advantage": {"name": "group"}})
    now = {"loss": {"name": "dcpo", "params": {}}, "advantage": {"name": "dcpo_smooth", "normalize_std": None}}
    assert resume_changes(saved, now) == {}


# Written out by hand: (old key, a value it took, the key it moved to, with the group to select for
# a builder's options).
VLLM_GROUP, REWARD_GROUP = " (select the group rollout/engine=vllm)", " (select the group reward=math_verify)"
MOVED = [
    ("rollout.max_new_tokens", "32", "rollout.sampling.max_new_tokens"),
    ("rollout.temperature", "0.5", "rollout.sampling.temperature"),
    ("rollout.top_p", "0.9", "rollout.sampling.top_p"),
    ("rollout.dynamic_sampling", "true", "rollout.sampling.dynamic_sampling"),
    ("rollout.max_sampling_rounds", "4", "rollout.sampling.max_sampling_rounds"),
    ("rollout.backend", "vllm", "rollout.engine.backend"),
    ("rollout.vllm.dtype", "float32", "rollout.engine.options.dtype" + VLLM_GROUP),
    ("rollout.engine.vllm.dtype", "float32", "rollout.engine.options.dtype" + VLLM_GROUP),
    ("rollout.engine.vllm.max_model_len", "512", "rollout.engine.options.max_model_len" + VLLM_GROUP),
    ("rollout.engine_options", "null", "rollout.engine.options"),
    ("rollout.refit_bucket_mb", "64", "rollout.refit.bucket_mb"),
    ("rollout.verify_refit", "true", "rollout.refit.verify"),
    ("rollout.correction", "token_tis", "rollout.correction.name"),
    ("rollout.correction_cap", "3.0", "rollout.correction.cap"),
    ("rollout.correction_low", "0.1", "rollout.correction.low"),
    ("rollout.correction_high", "4.0", "rollout.correction.high"),
    ("rollout.placement", "separate", "rollout.schedule.placement"),
    ("rollout.num_ranks", "1", "rollout.schedule.num_ranks"),
    ("rollout.peer_timeout_s", "60.0", "rollout.schedule.peer_timeout_s"),
    ("rollout.max_staleness", "1", "rollout.schedule.max_staleness"),
    ("rollout.staleness_schedule", "free", "rollout.schedule.mode"),
    ("rollout.stale_policy", "drop", "rollout.schedule.stale_policy"),
    ("rollout.partial", "true", "rollout.schedule.partial"),
    ("reward.num_workers", "4", "reward.options.num_workers" + REWARD_GROUP),
    ("reward.timeout_s", "2.0", "reward.options.timeout_s" + REWARD_GROUP),
]


@pytest.mark.parametrize("old, value, new", MOVED)
def test_a_moved_rollout_key_given_on_the_command_line_is_refused_naming_its_new_key(old, value, new):
    with pytest.raises(ValueError) as err:
        load_config(overrides=[f"{old}={value}"])
    assert str(err.value) == f"invalid config 'sspo_smollm2_cpu': {old} moved to {new}"


@pytest.mark.parametrize("old, value, new", MOVED)
def test_a_moved_rollout_key_in_a_yaml_file_is_refused_naming_its_new_key(old, value, new, tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(DEFAULT_CONFIG_DIR, conf)
    *sections, leaf = old.split(".")
    nested = "".join(f"{'  ' * depth}{name}:\n" for depth, name in enumerate(sections))
    (conf / "old.yaml").write_text(f"defaults:\n  - sspo_smollm2_cpu\n  - _self_\n{nested}"
                                   f"{'  ' * len(sections)}{leaf}: {value}\n")
    with pytest.raises(ValueError) as err:
        load_config("old", config_dir=conf)
    # A YAML file's key is reported at its first node the schema lacks: rollout.vllm for rollout.vllm.dtype.
    section = next((s for s in ("rollout.vllm", "rollout.engine.vllm") if old.startswith(f"{s}.")), None)
    reported, moved_to = (section, "rollout.engine.options" + VLLM_GROUP) if section else (old, new)
    assert str(err.value) == f"invalid config 'old': {reported} moved to {moved_to}"


def test_a_saved_flat_rollout_section_of_an_earlier_release_reads_in_the_nested_layout(tmp_path):
    (tmp_path / "config.yaml").write_text(
        "rollout:\n"
        "  prompts_per_step: 4\n  samples_per_prompt: 2\n  max_new_tokens: 128\n  temperature: 1.0\n"
        "  top_p: 1.0\n  backend: vllm\n"
        "  vllm:\n    tensor_parallel_size: 2\n    gpu_memory_utilization: 0.4\n    dtype: auto\n"
        "  engine_options: null\n  refit_bucket_mb: 512\n  verify_refit: false\n"
        "  correction: token_tis\n  correction_cap: 3.0\n  correction_low: 0.5\n  correction_high: 5.0\n"
        "  placement: separate\n  num_ranks: 1\n  peer_timeout_s: 600.0\n  max_staleness: 2\n"
        "  staleness_schedule: free\n  stale_policy: drop\n  partial: false\n"
        "  dynamic_sampling: true\n  max_sampling_rounds: 4\n"
        "trainer:\n  seed: 7\n")
    assert read_config(tmp_path) == {
        "rollout": {
            "prompts_per_step": 4,
            "samples_per_prompt": 2,
            "sampling": {"max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, "dynamic_sampling": True,
                         "max_sampling_rounds": 4},
            "engine": {"backend": "vllm",  # the vllm section is the vllm engine's options now
                       "options": {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.4, "dtype": "auto"}},
            "refit": {"bucket_mb": 512, "verify": False},
            "correction": {"name": "token_tis", "cap": 3.0, "low": 0.5, "high": 5.0},
            "schedule": {"placement": "separate", "num_ranks": 1, "peer_timeout_s": 600.0, "max_staleness": 2,
                         "mode": "free", "stale_policy": "drop", "partial": False},
        },
        "trainer": {"seed": 7},
    }


def test_a_saved_config_in_todays_rollout_layout_is_read_as_it_is():
    saved = {"rollout": {"prompts_per_step": 4, "correction": {"name": "token_tis", "cap": 2.0},
                         "engine": {"backend": "vllm", "options": {"dtype": "auto"}}},
             "reward": {"name": "math_verify", "options": {"num_workers": 2, "timeout_s": 5.0}}}
    assert upgrade_saved_config(saved) is saved


def test_the_vllm_and_math_verify_settings_of_the_last_release_move_into_options():
    vllm = {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.4, "cpu_kv_cache_gib": 1.0, "dtype": "auto",
            "max_model_len": 4096, "enforce_eager": False, "enable_sleep_mode": True}
    saved = {"rollout": {"engine": {"backend": "vllm", "vllm": dict(vllm), "options": None}},
             "reward": {"name": "math_verify", "options": None, "num_workers": 8, "timeout_s": 5.0,
                        "overlong_buffer_len": 0, "overlong_penalty": 1.0}}
    assert upgrade_saved_config(saved) == {
        "rollout": {"engine": {"backend": "vllm", "options": vllm}},
        "reward": {"name": "math_verify", "options": {"num_workers": 8, "timeout_s": 5.0},
                   "overlong_buffer_len": 0, "overlong_penalty": 1.0}}


def test_settings_another_reward_or_engine_never_read_are_dropped_and_its_options_kept():
    saved = {"rollout": {"engine": {"backend": "hf", "vllm": {"dtype": "auto"}, "options": None}},
             "reward": {"name": "exact_number", "options": {"tolerance": 0.5}, "num_workers": 2, "timeout_s": 5.0}}
    assert upgrade_saved_config(saved) == {"rollout": {"engine": {"backend": "hf", "options": None}},
                                           "reward": {"name": "exact_number", "options": {"tolerance": 0.5}}}
    # The flat layout before: rollout.vllm beside a plug-in engine's rollout.engine_options.
    flat = {"rollout": {"backend": "my_engine", "vllm": {"dtype": "auto"}, "engine_options": {"seed_offset": 7}}}
    assert upgrade_saved_config(flat) == {"rollout": {"engine": {"backend": "my_engine",
                                                                 "options": {"seed_offset": 7}}}}


def test_resuming_a_vllm_recipe_run_of_the_last_release_lists_no_change():
    now = composed_config(load_config("sspo_qwen2.5_math_7b", command="eval"))
    engine, reward = now["rollout"]["engine"], now["reward"]
    last = {**now, "rollout": {**now["rollout"], "engine": {"backend": "vllm", "vllm": engine["options"],
                                                            "options": None}},
            "reward": {**{k: v for k, v in reward.items() if k != "options"}, "options": None, **reward["options"]}}
    assert last["reward"]["num_workers"] == 8 and last["rollout"]["engine"]["vllm"]["tensor_parallel_size"] == 2
    saved = upgrade_saved_config(last)
    assert resume_changes(saved, now) == {} and resume_mismatches(saved, now) == []


def test_resuming_an_earlier_releases_separate_run_lists_no_rollout_change():
    cfg = load_config(overrides=["rollout.schedule.placement=separate", "rollout.schedule.num_ranks=1",
                                 "rollout.correction.name=token_tis", "rollout.sampling.temperature=1.0"],
                      command="eval")
    now = composed_config(cfg)
    rollout = now["rollout"]
    flat = {"prompts_per_step": rollout["prompts_per_step"], "samples_per_prompt": rollout["samples_per_prompt"],
            **rollout["sampling"], **{k: v for k, v in rollout["engine"].items() if k != "options"},
            "vllm": asdict(VLLMOptions()),  # saved by every earlier release; the hf engine never read it
            "engine_options": rollout["engine"]["options"], "refit_bucket_mb": rollout["refit"]["bucket_mb"],
            "verify_refit": rollout["refit"]["verify"], "correction": rollout["correction"]["name"],
            **{f"correction_{k}": rollout["correction"][k] for k in ("cap", "low", "high")},
            **{k: v for k, v in rollout["schedule"].items() if k != "mode"},
            "staleness_schedule": rollout["schedule"]["mode"]}
    saved = upgrade_saved_config({**now, "rollout": flat})
    assert resume_changes(saved, now) == {} and resume_mismatches(saved, now) == []
    assert data_parallel_size(saved, 2) == 1
