"""A config with problems of every kind (an unknown key, a key of an earlier release, a wrong type, a
value outside its set, a loss that does not exist, a key added with ``+``, a failed check) gets one
error listing all of them, whatever the order of the overrides and whether they come from the command
line or a YAML file. The expected messages are written out by hand."""

import shutil

import pytest

from nemo_sspo.cli import DEFAULT_CONFIG_DIR, load_config, main

TRAINER_KEYS = ("max_steps, minibatches_per_step, seed, output_dir, overwrite_output_dir, save_hf_checkpoint, "
                "checkpoint_interval, keep_checkpoints, resume, loggers, progress_interval_s, rollout_log, wandb, "
                "mlflow, gpu_memory_gib, skip_memory_check")
OPTIM_KEYS = ("lr, weight_decay, adam_beta1, adam_beta2, adam_eps, clip_grad, use_distributed_optimizer, "
              "cpu_offload, lr_schedule, lr_warmup_steps, lr_decay_steps, min_lr")

OVERRIDES = {  # override -> its problem
    "trainer.max_stepz=3": f"trainer.max_stepz: trainer has no key 'max_stepz'; did you mean 'trainer.max_steps'? "
                           f"Valid keys of trainer: {TRAINER_KEYS}",
    "rollout.temperature=0.5": "rollout.temperature moved to rollout.sampling.temperature",
    "rollout.engine_options.dtype=bf16": "rollout.engine_options.dtype moved to rollout.engine.options.dtype",
    "loss.params.gamma=abc": "loss.params.gamma='abc': Value 'abc' of type 'str' could not be converted to Float",
    "optim.lr=fast": "optim.lr='fast': Value 'fast' of type 'str' could not be converted to Float",
    "model.precision=fp16": "model.precision='fp16' is unknown; valid: fp32, bf16",
    "+optim.momentum=0.9": f"optim.momentum: optim has no key 'momentum'. Valid keys of optim: {OPTIM_KEYS}",
    "+trainer.seed=7": "trainer.seed is a key already: set it without '+' (trainer.seed=7)",
    "~trainer.max_stepz": f"trainer.max_stepz: trainer has no key 'max_stepz'; did you mean 'trainer.max_steps'? "
                          f"Valid keys of trainer: {TRAINER_KEYS}",
    "trainer.max_steps=0": "trainer.max_steps must be >= 1",
    "+loss=grpo": "loss is a group already: set it without '+' (loss=grpo)",
    "~loss.params.gamma": "loss.params.gamma: a field cannot be deleted; set it to another value instead "
                          "(loss.params.gamma=...)",
    "parallel=tp4": "parallel=tp4 is not an option of the group parallel; options: ep2, pp2, single, tp2, tp3",
}


def _problems(err: pytest.ExceptionInfo, name: str = "sspo_smollm2_cpu") -> list[str]:
    """The numbered problems of a load's error."""
    head, *listed = str(err.value).splitlines()
    assert head == f"invalid config {name!r}: {len(listed)} config problems:"
    return [line.split(". ", 1)[1] for line in listed]


@pytest.mark.parametrize("order", [1, -1], ids=["as written", "reversed"])
def test_every_kind_of_problem_is_reported_in_one_error(order):
    with pytest.raises(ValueError) as err:
        load_config(overrides=list(OVERRIDES)[::order], command="eval")
    assert sorted(_problems(err)) == sorted(set(OVERRIDES.values()))  # each once: two overrides share one


def test_a_loss_that_does_not_exist_is_reported_with_the_rest():
    with pytest.raises(ValueError) as err:
        load_config(overrides=["loss=sspo_typo", "trainer.seed=abc"], command="eval")
    assert _problems(err) == [
        "loss=sspo_typo is neither a registered policy loss nor a variant YAML of the group loss; registered: "
        "['cispo', 'clip_cov', 'dapo', 'dcpo', 'dr_grpo', 'gmpo', 'grpo', 'gspo', 'gspo_token', 'kl_cov', 'lpo', "
        "'sapo', 'soft_seq_po', 'sppo', 'sspo', 'sspo_fixed_clip']. A loss of your own is added by the module that "
        "registers it: plugins=[my_loss.py] loss=sspo_typo (docs/extending.md)",
        "trainer.seed='abc': Value 'abc' of type 'str' could not be converted to Integer"]


def test_a_yaml_files_problems_are_reported_with_the_overrides(tmp_path):
    conf = shutil.copytree(DEFAULT_CONFIG_DIR, tmp_path / "conf")
    (conf / "mine.yaml").write_text(
        "defaults:\n  - sspo_smollm2_cpu\n  - _self_\n"
        "trainer:\n  max_stepz: 3\n  seed: abc\n"
        "rollout:\n  temperature: 0.5\n  correction: token_tis\n")
    with pytest.raises(ValueError) as err:
        load_config("mine", ["optim.lr=-1"], config_dir=conf, command="eval")
    assert _problems(err, "mine") == [
        "rollout.correction moved to rollout.correction.name",
        "rollout.temperature moved to rollout.sampling.temperature",
        "trainer.seed='abc': Value 'abc' of type 'str' could not be converted to Integer",
        f"trainer.max_stepz: trainer has no key 'max_stepz'; did you mean 'trainer.max_steps'? Valid keys of "
        f"trainer: {TRAINER_KEYS}",
        "optim.lr=-1.0 must be > 0 and finite"]  # and no min_lr problem of its own: min_lr=0 is fine


def test_a_key_added_to_the_losss_params_names_the_losses_that_have_it():
    with pytest.raises(ValueError) as err:
        load_config(overrides=["+loss.params.dual_clip_c=3", "trainer.max_steps=0"], command="eval")
    assert _problems(err) == [
        "loss.params.dual_clip_c: SSPOLossConfig (loss 'sspo') has no field 'dual_clip_c'. Valid fields: aggregation, "
        "kl_coef, kl_estimator, entropy_coef, segmentation, segment_k, alpha, beta, gamma, lower_bound. 'dual_clip_c' is "
        "a field of the losses ['clip_cov', 'dapo', 'dcpo', 'dr_grpo', 'grpo', 'sppo'], not of 'sspo'. To switch to one "
        "of them, select its group (e.g. `loss=clip_cov`), which replaces loss.params with that loss's defaults, rather than setting loss.name",
        "trainer.max_steps must be >= 1"]


def test_the_command_line_prints_every_problem_and_exits_2(capsys):
    assert main(["train", "--print-config", "trainer.max_steps=two", "optim.lrr=1"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "nemo-sspo: invalid config 'sspo_smollm2_cpu': 2 config problems:",
        f"  1. optim.lrr: optim has no key 'lrr'; did you mean 'optim.lr'? Valid keys of optim: {OPTIM_KEYS}",
        "  2. trainer.max_steps='two': Value 'two' of type 'str' could not be converted to Integer"]


def test_a_losss_own_check_is_named_by_its_key_path_and_reported_with_the_rest():
    # SSPO needs gamma >= 1 (b_low <= 1 <= b_high): the loss config refuses gamma=0.5 when built; the
    # loader names it loss.params and checks the rest with the loss's defaults.
    with pytest.raises(ValueError) as err:
        load_config(overrides=["loss.params.gamma=0.5", "optim.lr=fast"], command="eval")
    assert _problems(err) == [
        "optim.lr='fast': Value 'fast' of type 'str' could not be converted to Float",
        "loss.params.alpha=0.0, beta=0.8, gamma=0.5: need alpha >= 0, 0 <= beta <= 1 and gamma >= 1 (so that "
        "b_low <= 1 <= b_high)"]
    with pytest.raises(ValueError) as err:
        load_config(overrides=["loss.params.gamma=0.5"], command="eval")
    assert str(err.value) == ("invalid config 'sspo_smollm2_cpu': loss.params.alpha=0.0, beta=0.8, gamma=0.5: need "
                              "alpha >= 0, 0 <= beta <= 1 and gamma >= 1 (so that b_low <= 1 <= b_high)")


def test_a_loss_named_without_its_group_is_reported_with_the_rest():
    with pytest.raises(ValueError) as err:
        load_config(overrides=["loss.name=grpo", "trainer.max_steps=0"], command="eval")
    assert _problems(err) == [
        "loss.name='grpo' needs loss.params of type GRPOLossConfig, got SSPOLossConfig: select the loss as a group "
        "(loss=grpo) instead of setting loss.name",
        "trainer.max_steps must be >= 1"]


def test_an_interpolation_that_does_not_resolve_is_named_by_its_key():
    with pytest.raises(ValueError) as err:
        load_config(overrides=["trainer.seed=${trainer.sead}"], command="eval")
    assert str(err.value) == "invalid config 'sspo_smollm2_cpu': trainer.seed: Interpolation key 'trainer.sead' not found"


@pytest.mark.parametrize("lines, problem", [
    ("loss:\n  params:\n    eps_low: abc\n",
     "loss.params.eps_low: Value 'abc' of type 'str' could not be converted to Float"),
    ("loss:\n  params:\n    eps_lo: 0.1\n",
     "loss.params.eps_lo: DCPOLossConfig (loss 'dcpo') has no field 'eps_lo'; did you mean 'eps_low'? Valid fields: "
     "aggregation, kl_coef, kl_estimator, entropy_coef, eps_low, eps_high, ratio_max, dual_clip_c"),
], ids=["value", "key"])
def test_a_problem_in_a_yaml_files_loss_params_comes_alone_named_by_its_key(tmp_path, lines, problem):
    # Hydra refuses it while composing the YAML file onto the loss's dataclass: nothing after it is read.
    conf = shutil.copytree(DEFAULT_CONFIG_DIR, tmp_path / "conf")
    (conf / "mine.yaml").write_text("defaults:\n  - sspo_smollm2_cpu\n  - override loss: dcpo\n  - _self_\n" + lines)
    with pytest.raises(ValueError) as err:
        load_config("mine", ["trainer.max_steps=0"], config_dir=conf, command="eval")
    assert str(err.value) == f"invalid config 'mine': {problem}"


def test_a_yaml_files_group_option_that_does_not_exist_is_named_with_the_registered_ones(tmp_path):
    conf = shutil.copytree(DEFAULT_CONFIG_DIR, tmp_path / "conf")
    (conf / "mine.yaml").write_text("defaults:\n  - sspo_smollm2_cpu\n  - override reward: nah\n  - _self_\n")
    with pytest.raises(ValueError) as err:
        load_config("mine", config_dir=conf, command="eval")
    # The registered rewards are math_verify and whatever tests run before registered.
    message = str(err.value)
    assert message.startswith("invalid config 'mine': reward=nah is not a registered reward; registered: [")
    assert "'math_verify'" in message and "'nah'" not in message
    assert message.endswith("] (a module that registers one is loaded with the config key plugins)")
