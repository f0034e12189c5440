"""The advantage keys of earlier releases are refused at load naming the new key, and a saved
``config.yaml`` of an earlier release is read in today's layout (resume)."""

import shutil

import pytest

from nemo_sspo.cli import DEFAULT_CONFIG_DIR, load_config
from nemo_sspo.trainer.config import upgrade_saved_config
from nemo_sspo.trainer.run_config import read_config, resume_changes


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
