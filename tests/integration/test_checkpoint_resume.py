"""Checkpoint/resume on the tiny random Llama, with in-loop evaluation and TIS switched on.

One 4-step run saves checkpoints at steps 2 and 4 (``trainer.checkpoint_interval=2``) and evaluates a
2-problem stub benchmark at steps 2 and 4. A second trainer resumes from the step-2 checkpoint and
runs steps 3-4: its metrics must equal the uninterrupted run's exactly (every key but timings; the
same fp32 CPU kernels run in the same order on restored bit-identical weights, optimizer moments
and Adam step counts, data position and sampling seeds, so exact equality is the expected result,
not a tolerance). Its step-4 save is made to fail after the temporary folder is written: the
previous ``latest`` (the first run's step 4) must survive intact. A second test resumes an SPPO run,
whose critic and critic optimizer are checkpointed too.
"""

import json

import pytest
import torch

from nemo_sspo.models import load_hf_checkpoint
from nemo_sspo.trainer import checkpoint
from nemo_sspo.algorithms.batch import response_to_target_frame
from nemo_sspo.trainer.checkpoint import STATE_FILE, resolve_resume
from tests.integration._loop_runs import observe, record_rollouts, run


@pytest.fixture(scope="module")
def tiny():
    return load_hf_checkpoint("tiny-random-llama")


def _stub_benchmark(folder):
    """A 3-problem ``math500.jsonl`` (the loader warns that it is not the published file)."""
    folder.mkdir()
    rows = [{"id": str(i), "problem": f"What is {i} + 1?", "answer": str(i + 1), "source": "stub"} for i in range(3)]
    (folder / "math500.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _record_tis_inputs(store):
    """Appends (old log-probs, engine log-probs, mask), [B, S] in the target frame, for every step."""
    def capture(trainer):
        rollouts = []
        record_rollouts(trainer, rollouts)

        def record(batch):
            rb = rollouts[-1].batch
            engine = response_to_target_frame(rb.rollout_logprobs, rb.prompt_mask, batch.loss_mask.shape[1])
            store.append((batch.old_logprobs.clone(), engine, batch.loss_mask.clone()))

        observe(trainer, "batch", record)

    return capture


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _without_timings(record):
    return {k: v for k, v in record.items() if not k.startswith(("timing/", "throughput/"))}  # wall-clock based


def _killed_publish(tmp, final):
    raise RuntimeError(f"killed while publishing {tmp.name}")


def test_resume_matches_uninterrupted_run_and_failed_save_keeps_latest(monkeypatch, tmp_path, tiny):
    out = tmp_path / "run"
    overrides = [
        "trainer.max_steps=4", "trainer.checkpoint_interval=2", "trainer.keep_checkpoints=2",
        "rollout.correction.name=token_tis", "rollout.correction.cap=1.0", "eval.every_n_steps=2", "eval.benchmarks=[math500]", "eval.limit_per_benchmark=2",
        "eval.max_new_tokens=8", f"eval.data_dir={_stub_benchmark(tmp_path / 'data')}",
    ]
    tis_inputs = []
    straight = run(monkeypatch, out, overrides, checkpoint=tiny, capture=_record_tis_inputs(tis_inputs))
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_000004"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_000002", "step_000004"]

    # TIS and evaluation were active in the run being compared.
    # TIS weight per token min(pi_old / pi_rollout, 1) from the logged log-probs, averaged by hand.
    for (old, engine, mask), record in zip(tis_inputs, straight):
        weights = torch.exp(old.double() - engine.double()).clamp(max=1.0)[mask]
        assert record["rollout/is_weight"] == pytest.approx(float(weights.mean()), rel=1e-6)
        assert record["rollout/is_truncated_frac"] == pytest.approx(float((old > engine)[mask].float().mean()))
    assert any(r["rollout/is_truncated_frac"] > 0 for r in straight)  # HF and Megatron log-probs differ by rounding
    evaluated = [r for r in straight if "eval/mean" in r]
    assert [r["step"] for r in evaluated] == [2, 4]
    # best/ holds the first step with the highest eval/mean (a tie keeps the earlier step).
    top = max(r["eval/mean"] for r in evaluated)
    best = json.loads((out / "best" / "best.json").read_text())
    assert best["step"] == next(r["step"] for r in evaluated if r["eval/mean"] == top) and best["eval/mean"] == top
    assert (out / "best" / "model.safetensors").is_file()

    monkeypatch.setattr(checkpoint, "_publish", _killed_publish)
    with pytest.raises(RuntimeError, match="killed while publishing .step_000004.tmp"):
        run(monkeypatch, out, [*overrides, f"trainer.resume={ckpts / 'step_000002'}"], checkpoint=tiny)

    resumed = _records(out / "metrics.jsonl")  # rows 1-2 kept from the first run, 3-4 from the resumed one
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for mine, reference in zip(resumed, straight):
        assert _without_timings(mine) == _without_timings(reference), mine["step"]

    # The failed save left its temporary folder; `latest` and the step-4 checkpoint it names are untouched.
    assert (ckpts / ".step_000004.tmp" / STATE_FILE).is_file()
    assert (ckpts / "latest").read_text() == "step_000004"
    latest = resolve_resume("auto", out)
    assert latest == ckpts / "step_000004"
    assert json.loads((latest / STATE_FILE).read_text())["step"] == 4

    # A shard cut short after the save (files.json lists every file's size) is refused before anything
    # is read, naming the file and the previous complete checkpoint (used only when passed explicitly).
    manifest = json.loads((latest / "files.json").read_text())
    assert "rng/rank_00000.pt" in manifest and "config.yaml" in manifest
    name = next(n for n in manifest if n.startswith("policy/") and n.endswith(".distcp"))
    shard, size = latest / name, manifest[name]
    assert shard.stat().st_size == size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    with pytest.raises(ValueError) as err:
        checkpoint.load_checkpoint(resolve_resume("auto", out), {}, config={})
    assert f"{shard} is {size // 2} bytes, written with {size}" in str(err.value)
    assert f"trainer.resume={ckpts / 'step_000002'}" in str(err.value)


def test_sppo_critic_is_checkpointed(monkeypatch, tmp_path, tiny):
    out = tmp_path / "sppo"
    overrides = ["loss=sppo", "rollout.samples_per_prompt=1", "rollout.prompts_per_step=4", "critic.micro_batch_size=2",
                 "critic.num_layers=1", "critic.optim.lr=0.05", "trainer.max_steps=2", "trainer.checkpoint_interval=1"]
    straight = run(monkeypatch, out, overrides, checkpoint=tiny)
    assert (out / "checkpoints" / "step_000001" / "critic").is_dir()
    resumed = run(monkeypatch, out, [*overrides, f"trainer.resume={out / 'checkpoints' / 'step_000001'}"],
                  checkpoint=tiny)
    # The critic moved at step 1 (V != 0.5 at step 2) and the resumed critic predicts the same.
    assert straight[1]["critic/value_mean"] != pytest.approx(0.5, abs=1e-4)
    assert _without_timings(resumed[1]) == _without_timings(straight[1])
