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


def _earlier_run(out, *, checkpoint, config=True):
    out.mkdir()
    if config:  # every run writes its composed config first
        write_config(out, {"model": {"source": "tiny-random-llama"}, "trainer": {"seed": 1234}})
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


def _refusal(tmp_path, saved_parallel, world_size):
    saved = composed_config(load_config())
    saved["parallel"].update(saved_parallel)
    folder = _checkpoint(tmp_path / "step_000002", saved, world_size=world_size)
    with pytest.raises(ValueError) as err:  # this process: world size 1, TP = PP = EP = 1, DP 1
        load_checkpoint(folder, {}, config=composed_config(load_config()))
    return str(err.value)


def test_resume_refusal_names_every_layout_size_that_differs(tmp_path):
    # Checkpoint: EP 2 on 2 processes, TP = PP = 1 -> DP 2 (EP is carved out of the DP ranks).
    message = _refusal(tmp_path / "ep", {"expert_model_parallel_size": 2}, 2)
    for line in ("parallel.expert_model_parallel_size: checkpoint 2, now 1",
                 "world size (processes): checkpoint 2, now 1", "data-parallel size: checkpoint 2, now 1"):
        assert line in message, (line, message)
    # Checkpoint: TP 2 x PP 2 on 4 processes -> DP 1, as now: the sizes that differ are named, DP is not.
    message = _refusal(tmp_path / "tp", {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}, 4)
    assert "parallel.tensor_model_parallel_size: checkpoint 2, now 1" in message
    assert "parallel.pipeline_model_parallel_size: checkpoint 2, now 1" in message
    assert "data-parallel size" not in message


def test_overwrite_clears_every_artifact_of_the_earlier_run(tmp_path):
    out = tmp_path / "run"
    _earlier_run(out, checkpoint=True)
    # What a run with every logger, a timeline and a killed model-folder write leaves (RUN_OUTPUTS).
    for name in ("throughput_summary.json", "trackers.json", "mlflow.db", "timeline.jsonl", "timeline.png"):
        (out / name).write_text("x")
    for folder in ("wandb/offline-run-20260101_000000-abc", "mlflow_artifacts/1/abc", ".hf_checkpoint.tmp",
                   "hf_checkpoint", "best", "eval"):
        (out / folder).mkdir(parents=True)
        (out / folder / "f").write_text("x")
    prepare_output_dir(_trainer(out, True), is_writer=True)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_leftovers_of_a_run_stopped_before_its_first_step_are_cleared(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    write_config(out, {"model": {}, "trainer": {}})
    (out / "wandb").mkdir()
    (out / "trackers.json").write_text("{}")
    prepare_output_dir(_trainer(out, False), is_writer=True)  # nothing held: no refusal, nothing deleted
    assert (out / "wandb").is_dir()
    prepare_output_dir(_trainer(out, True), is_writer=True)
    assert list(out.iterdir()) == []


def test_overwrite_refuses_a_folder_that_is_not_a_run_folder(tmp_path, monkeypatch):
    out = tmp_path / "home"
    _earlier_run(out, checkpoint=False, config=False)  # a metrics.jsonl of something else, no config.yaml
    (out / "wandb").mkdir()  # e.g. a user's own W&B folder in their home
    for is_writer in (True, False):
        with pytest.raises(ValueError) as err:
            prepare_output_dir(_trainer(out, True), is_writer=is_writer)
        message = str(err.value)
        assert "trainer.overwrite_output_dir=true" in message and repr(str(out)) in message
        assert "holds metrics.jsonl, tensorboard, wandb but no composed config.yaml" in message
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "notes.txt", "tensorboard", "wandb"]
    # The home folder is refused even when it holds a run's config.yaml (a user passing ~).
    write_config(out, {"model": {}, "trainer": {}})
    monkeypatch.setenv("HOME", str(out))
    with pytest.raises(ValueError, match="or it is the home or root folder"):
        prepare_output_dir(_trainer(out, True), is_writer=True)
    assert (out / "metrics.jsonl").is_file()


def test_a_damaged_checkpoint_is_refused_naming_the_file_and_the_previous_one(tmp_path):
    from nemo_sspo.trainer.checkpoint import _write_manifest

    root = tmp_path / "checkpoints"
    config = {"trainer": {"seed": 1234}}
    first, second = (_checkpoint(root / f"step_00000{s}", config) for s in (2, 4))
    for folder in (first, second):
        (folder / "policy").mkdir()
        (folder / "policy" / "__0_0.distcp").write_bytes(b"w" * 100)
        _write_manifest(folder)
    (second / "policy" / "__0_0.distcp").write_bytes(b"w" * 60)  # cut short
    with pytest.raises(ValueError) as err:
        load_checkpoint(second, {}, config=config)
    message = str(err.value)
    assert f"{second / 'policy' / '__0_0.distcp'} is 60 bytes, written with 100" in message
    assert f"trainer.resume={first}" in message  # the previous complete checkpoint, only named
    (second / "policy" / "__0_0.distcp").unlink()
    with pytest.raises(ValueError, match="__0_0.distcp is missing"):
        load_checkpoint(second, {}, config=config)
    # A truncated trainer_state.json (not in files.json: written after it) is named too; the first
    # checkpoint has no earlier one to offer.
    (first / STATE_FILE).write_text('{"step": 2, "probl')
    with pytest.raises(ValueError, match="trainer_state.json is unreadable .*no earlier complete checkpoint"):
        load_checkpoint(first, {}, config=config)


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
    # every output of the earlier run moves, its composed config.yaml too (RUN_OUTPUTS)
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoints", "config.yaml", "metrics.jsonl", "tensorboard"]
    assert (aside / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert [r.getMessage() for r in caplog.records] == [
        f"trainer.resume=auto: {out} holds an earlier run without a checkpoint (1 step(s) in metrics.jsonl); "
        f"moved its outputs (metrics.jsonl, tensorboard, checkpoints, config.yaml) to {aside} and starting fresh"]
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
        "optim.lr=1e-5", "trainer.max_steps=20", "reward.options.num_workers=4", "trainer.resume=auto"]))  # allowed
    assert resume_mismatches(saved, now) == ["reward.overlong_buffer_len: checkpoint 0, now 8",
                                             "reward.overlong_penalty: checkpoint 1.0, now 0.5"]
    assert resume_changes(saved, now) == {"optim.lr": (2e-5, 1e-5), "reward.options.num_workers": (2, 4),
                                          "trainer.max_steps": (12, 20)}  # trainer.resume is not a change
    assert resume_changes(saved, saved) == {}
    renamed = {**saved, "reward": {**saved["reward"], "name": "my_reward"}}
    assert resume_mismatches(saved, renamed) == ["reward.name: checkpoint 'math_verify', now 'my_reward'"]
