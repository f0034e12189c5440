"""Runs that are safe to resume: the composed config saved with each run and compared on resume,
and an output folder that a new run either refuses or clears completely."""

import json
from types import SimpleNamespace

import pytest

from nemo_sspo.cli import load_config
from nemo_sspo.trainer.checkpoint import STATE_FILE, load_checkpoint, prepare_output_dir, resolve_resume
from nemo_sspo.trainer.run_config import composed_config, read_config, resume_changes, resume_mismatches, write_config


def _checkpoint(folder, config, *, seed=1234, world_size=1):
    folder.mkdir(parents=True)
    (folder / STATE_FILE).write_text(json.dumps({"step": 2, "problems_drawn": 4, "seed": seed,
                                                 "world_size": world_size}))
    if config is not None:
        write_config(folder, config)
    return folder


def test_config_round_trips_through_yaml(tmp_path):
    config = composed_config(load_config(overrides=["loss=grpo", "trainer.max_steps=3"]))
    write_config(tmp_path, config)
    assert read_config(tmp_path) == config
    assert config["trainer"]["max_steps"] == 3 and config["loss"]["name"] == "grpo"
    assert read_config(tmp_path / "elsewhere") is None


def test_resume_lists_every_changed_layout_model_and_batch_key():
    saved = composed_config(load_config())
    now = composed_config(load_config(overrides=[
        "parallel.tensor_model_parallel_size=3", "model=tiny_random", "rollout.prompts_per_step=4",
        "data.options.pool_size=4",
        # allowed to change on resume: run length, memory knobs, learning rate, where outputs go
        "trainer.max_steps=20", "parallel.micro_batch_size=2", "optim.lr=1e-5", "trainer.output_dir=/tmp/x"],
        command="eval"))  # eval: no world-size check of the layout here
    assert resume_mismatches(saved, now) == [
        "data.options.pool_size: checkpoint 8, now 4",
        "model.source: checkpoint 'smollm2-135m-instruct', now 'tiny-random-llama'",
        "parallel.tensor_model_parallel_size: checkpoint 1, now 3",
        "rollout.prompts_per_step: checkpoint 2, now 4",
    ]
    assert resume_mismatches(saved, saved) == []


def test_load_checkpoint_refuses_another_config_before_reading_weights(tmp_path):
    saved = composed_config(load_config())
    now = composed_config(load_config(overrides=["rollout.samples_per_prompt=4", "trainer.seed=7"]))
    folder = _checkpoint(tmp_path / "step_000002", saved, world_size=2)
    # models={} and no rng/ folder: reaching the weights would fail otherwise.
    with pytest.raises(ValueError) as err:
        load_checkpoint(folder, {}, config=now)
    message = str(err.value)
    assert "rollout.samples_per_prompt: checkpoint 8, now 4" in message
    assert "trainer.seed: checkpoint 1234, now 7" in message
    assert "world size (processes): checkpoint 2, now 1" in message
    assert str(folder / "config.yaml") in message


def test_checkpoint_without_saved_config_is_checked_on_its_seed(tmp_path):
    folder = _checkpoint(tmp_path / "step_000002", None, seed=99)
    with pytest.raises(ValueError, match="trainer.seed: checkpoint 99, now 1234"):
        load_checkpoint(folder, {}, config=composed_config(load_config()))


def _earlier_run(out, *, checkpoint):
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events.out.tfevents.1").write_text("x")
    (out / "notes.txt").write_text("mine")  # not a run output: never deleted
    if checkpoint:
        _checkpoint(out / "checkpoints" / "step_000004", {"trainer": {"seed": 1234}})
        (out / "checkpoints" / "latest").write_text("step_000004")


def _trainer(out, overwrite, resume=None):
    return SimpleNamespace(output_dir=str(out), overwrite_output_dir=overwrite, resume=resume)


def test_earlier_run_with_a_checkpoint_is_refused_naming_resume_first(tmp_path):
    out = tmp_path / "run"
    _earlier_run(out, checkpoint=True)
    with pytest.raises(ValueError) as err:
        prepare_output_dir(_trainer(out, False), is_writer=True)
    message = str(err.value)
    assert "holds an earlier run" in message
    fixes = [message.index(fix) for fix in ("trainer.resume=auto", "trainer.overwrite_output_dir=true",
                                            "another trainer.output_dir")]
    assert fixes == sorted(fixes)
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'  # nothing touched


def test_earlier_run_without_checkpoint_does_not_suggest_resume(tmp_path):
    out = tmp_path / "run"
    _earlier_run(out, checkpoint=False)
    with pytest.raises(ValueError, match="without a checkpoint to resume from") as err:
        prepare_output_dir(_trainer(out, False), is_writer=True)
    assert "trainer.resume" not in str(err.value)


def test_overwrite_removes_the_old_checkpoints_so_auto_resume_starts_fresh(tmp_path):
    out = tmp_path / "run"
    _earlier_run(out, checkpoint=True)
    assert resolve_resume("auto", out) == out / "checkpoints" / "step_000004"
    prepare_output_dir(_trainer(out, True), is_writer=False)  # other ranks only check
    assert (out / "checkpoints" / "latest").is_file()
    prepare_output_dir(_trainer(out, True), is_writer=True)
    assert resolve_resume("auto", out) is None
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_auto_resume_without_a_checkpoint_moves_the_earlier_run_aside_and_starts_fresh(tmp_path, caplog):
    """A job requeued before its first checkpoint (issue 32): the recipes' trainer.resume=auto starts
    fresh instead of refusing, and the earlier run's outputs are kept in earlier_run_<k>/."""
    out = tmp_path / "run"
    _earlier_run(out, checkpoint=False)
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / ".step_000002.tmp").mkdir()  # killed during its first save: no latest
    assert prepare_output_dir(_trainer(out, False, "auto"), is_writer=False) is None  # other ranks only check
    assert (out / "metrics.jsonl").is_file()
    with caplog.at_level("WARNING", logger="nemo_sspo.trainer.checkpoint"):
        aside = prepare_output_dir(_trainer(out, False, "auto"), is_writer=True)
    assert aside == out / "earlier_run_1"
    assert sorted(p.name for p in out.iterdir()) == ["earlier_run_1", "notes.txt"]
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoints", "metrics.jsonl", "tensorboard"]
    assert (aside / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert [r.getMessage() for r in caplog.records] == [
        f"trainer.resume=auto: {out} holds an earlier run without a checkpoint (1 step(s) in metrics.jsonl); "
        f"moved its outputs (metrics.jsonl, tensorboard, checkpoints) to {aside} and starting fresh"]
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')  # requeued again before a checkpoint
    assert prepare_output_dir(_trainer(out, False, "auto"), is_writer=True) == out / "earlier_run_2"
    assert resolve_resume("auto", out) is None  # the run starts at step 1
    with pytest.raises(ValueError, match="without a checkpoint to resume from"):  # without resume=auto: refused
        (out / "metrics.jsonl").write_text('{"step": 1}\n')
        prepare_output_dir(_trainer(out, False, None), is_writer=True)


def test_resume_refuses_a_changed_reward_and_lists_the_allowed_changes():
    """A changed reward is refused like a changed loss (issue 32); what a resume may change is
    listed with both values (the defaults: lr 2e-5, 12 steps, 2 reward workers)."""
    saved = composed_config(load_config())
    now = composed_config(load_config(overrides=[
        "reward.overlong_buffer_len=8", "reward.overlong_penalty=0.5",  # the reward's shaping: refused
        "optim.lr=1e-5", "trainer.max_steps=20", "reward.num_workers=4", "trainer.resume=auto"]))  # allowed
    assert resume_mismatches(saved, now) == ["reward.overlong_buffer_len: checkpoint 0, now 8",
                                             "reward.overlong_penalty: checkpoint 1.0, now 0.5"]
    assert resume_changes(saved, now) == {"optim.lr": (2e-5, 1e-5), "reward.num_workers": (2, 4),
                                          "trainer.max_steps": (12, 20)}  # trainer.resume is not a change
    assert resume_changes(saved, saved) == {}
    renamed = {**saved, "reward": {**saved["reward"], "name": "my_reward"}}
    assert resume_mismatches(saved, renamed) == ["reward.name: checkpoint 'math_verify', now 'my_reward'"]
