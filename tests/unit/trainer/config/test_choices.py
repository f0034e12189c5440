"""Settings with a fixed set of values are ``Choice`` enums: the loader refuses any other value in one
message naming the key, the value and every valid value (an override and a YAML file's value alike);
a good value equals its plain string, and the printed and saved configs hold the plain string."""

import shutil

import pytest
import yaml
from omegaconf import OmegaConf

from nemo_sspo.cli import DEFAULT_CONFIG_DIR, load_config, main
from nemo_sspo.trainer.run_config import composed_config, read_config, resume_changes, write_config

# Written out by hand: the test must fail when a value is added, dropped or reordered unnoticed.
CHOICES = [
    ("rollout.schedule.placement", "colocated, separate", "separate"),
    ("rollout.schedule.mode", "lockstep, free", "lockstep"),
    ("rollout.schedule.stale_policy", "wait, drop", "wait"),
    ("rollout.correction.name", "none, token_tis, sequence_tis, segment_tis, token_mask, sequence_mask", "segment_tis"),
    ("optim.lr_schedule", "constant, linear, cosine", "cosine"),
    ("critic.optim.lr_schedule", "constant, linear, cosine", "linear"),
    ("model.precision", "fp32, bf16", "fp32"),
    ("model.output_layer_precision", "auto, bf16, tf32, fp32", "fp32"),
    ("model.fp8_recipe", "delayed, tensorwise, mxfp8, blockwise", "blockwise"),
    ("model.transformer_impl", "auto, local, transformer_engine", "local"),
    ("model.router_replay", "none, r2, r3", "none"),
    ("parallel.recompute", "none, selective, full", "selective"),
    ("parallel.recompute_method", "uniform, block", "uniform"),
    ("trainer.wandb.mode", "offline, online", "online"),
]
"""(key, every valid value in order, a good value that loads)."""
NEEDS = {"rollout.schedule.placement": ["rollout.schedule.num_ranks=1"]}
"""What a good value needs besides the defaults."""


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = cfg[part] if isinstance(cfg, dict) else getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("key, valid, good", CHOICES)
def test_a_bad_override_names_the_key_the_value_and_every_valid_value(key, valid, good):
    with pytest.raises(ValueError) as err:
        load_config(overrides=[f"{key}=bogus"])
    assert str(err.value) == f"invalid config 'sspo_smollm2_cpu': {key}='bogus' is unknown; valid: {valid}"


def test_a_bad_value_in_a_yaml_file_gets_the_same_message(tmp_path):
    conf = shutil.copytree(DEFAULT_CONFIG_DIR, tmp_path / "conf")
    (conf / "mine.yaml").write_text("defaults:\n  - sspo_smollm2_cpu\n  - _self_\nrollout:\n  schedule:\n    placement: remote\n")
    with pytest.raises(ValueError) as err:
        load_config("mine", config_dir=conf)
    assert str(err.value) == "invalid config 'mine': rollout.schedule.placement='remote' is unknown; valid: colocated, separate"


def test_every_bad_value_is_reported_with_the_configs_other_problems(tmp_path):
    # OmegaConf stops at the first value outside a field's names; the loader lists them all (a YAML
    # file's and the overrides'), in field order, then the problems of the rest of the config.
    conf = shutil.copytree(DEFAULT_CONFIG_DIR, tmp_path / "conf")
    (conf / "mine.yaml").write_text("defaults:\n  - sspo_smollm2_cpu\n  - _self_\nrollout:\n  schedule:\n    placement: remote\n")
    with pytest.raises(ValueError) as err:
        load_config("mine", ["optim.lr_schedule=cosin", "model.precision=fp16", "rollout.refit.bucket_mb=0",
                             "loss.params.gamma=2.5"], config_dir=conf)
    assert str(err.value) == (
        "invalid config 'mine': 4 config problems:\n"
        "  1. model.precision='fp16' is unknown; valid: fp32, bf16\n"
        "  2. rollout.schedule.placement='remote' is unknown; valid: colocated, separate\n"
        "  3. optim.lr_schedule='cosin' is unknown; valid: constant, linear, cosine\n"
        "  4. rollout.refit.bucket_mb=0 must be > 0 (MiB per refit bucket; 256 by default, a layer larger "
        "than it is sent alone)")


def test_a_bad_value_beside_the_override_of_a_missing_key_is_reported_with_it():
    # The override of a missing key stops even the composition over the untyped schema: it is left
    # out, reported, and the bad value found in the rest.
    with pytest.raises(ValueError) as err:
        load_config(overrides=["model.precision=fp16", "trainer.max_stepz=2"])
    assert str(err.value).splitlines()[:3] == [
        "invalid config 'sspo_smollm2_cpu': 2 config problems:",
        "  1. trainer.max_stepz: trainer has no key 'max_stepz'; did you mean 'trainer.max_steps'? Valid keys of "
        "trainer: max_steps, minibatches_per_step, seed, output_dir, overwrite_output_dir, save_hf_checkpoint, "
        "checkpoint_interval, keep_checkpoints, resume, loggers, progress_interval_s, rollout_log, wandb, mlflow, "
        "gpu_memory_gib, skip_memory_check",
        "  2. model.precision='fp16' is unknown; valid: fp32, bf16"]


def test_the_command_line_prints_the_message_once(capsys):
    assert main(["train", "--print-config", "rollout.schedule.stale_policy=skip"]) == 2
    assert capsys.readouterr().err.strip() == (
        "nemo-sspo: invalid config 'sspo_smollm2_cpu': rollout.schedule.stale_policy='skip' is unknown; valid: wait, drop")


@pytest.mark.parametrize("key, valid, good", CHOICES)
def test_a_good_value_equals_its_string_and_is_saved_as_the_plain_string(key, valid, good, tmp_path):
    cfg = load_config(overrides=[f"{key}={good}", *NEEDS.get(key, [])], command="eval")
    value = _get(cfg, key)
    assert value == good and f"{value}" == good and str(value) == good and repr(value) == repr(good)
    assert f"{key.rsplit('.', 1)[1]}: {good}\n" in OmegaConf.to_yaml(OmegaConf.structured(cfg))
    composed = composed_config(cfg)
    assert type(_get(composed, key)) is str and _get(composed, key) == good
    write_config(tmp_path, composed)
    assert type(_get(read_config(tmp_path), key)) is str
    yaml.safe_dump(composed)  # plain YAML types only: a str subclass would be refused here


def test_a_config_yaml_written_with_plain_strings_resumes_without_changes(tmp_path):
    cfg = load_config(overrides=["rollout.correction.name=token_tis", "optim.lr_schedule=cosine"])
    # As a release with str fields wrote it: every value a plain YAML scalar.
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(composed_config(cfg)), encoding="utf-8")
    assert "correction:\n    cap: 2.0\n    high: 5.0\n    low: 0.5\n    name: token_tis\n" in (
        tmp_path / "config.yaml").read_text()
    assert resume_changes(read_config(tmp_path), composed_config(cfg)) == {}
