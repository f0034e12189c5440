"""GRPO steps with LoRA on the tiny random Llama: the base model as the KL reference, the merged
refit checked against the engine's read-back, and a resume equal to the uninterrupted run.

One 2-step run (rank-4 adapters, SSPO with a k3 reference-KL term, ``rollout.refit.verify=true``,
checkpoints every step, the final HF folder with its PEFT adapter) and one resume from its step-1
checkpoint, then one onto other base weights, which is refused.
"""

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from nemo_sspo.models import build_hf_model, load_hf_checkpoint
from tests.integration._loop_runs import observe, run, untimed

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "optim.lr=1e-2", "loss.params.kl_coef=0.1",
        "rollout.refit.verify=true", "trainer.checkpoint_interval=1", "trainer.save_hf_checkpoint=true"]


@pytest.fixture(scope="module")
def tiny():
    return load_hf_checkpoint("tiny-random-llama")


def _record_logprobs(store):
    def capture(trainer):
        observe(trainer, "batch", lambda batch: store.append((batch.old_logprobs.clone(), batch.ref_logprobs.clone(),
                                                              batch.loss_mask.clone())))
    return capture


def test_lora_run_uses_the_base_model_as_reference_and_resumes_exactly(monkeypatch, tmp_path, tiny):
    out = tmp_path / "run"
    seen = []
    straight = run(monkeypatch, out, LORA, checkpoint=tiny, capture=_record_logprobs(seen))
    # Step 1: B = 0, so the policy is its base model and pi_ref = pi_old exactly. From step 2 the
    # adapters have moved: the reference (adapters off) stays the base model, the policy does not.
    (old1, ref1, mask1), (old2, ref2, mask2) = seen[0], seen[1]
    assert torch.equal(old1[mask1], ref1[mask1])
    assert (old2 - ref2)[mask2].abs().max() > 1e-4
    # rollout.refit.verify: every refit was read back from the engine bit for bit, or the step would have raised.
    # Each refit loaded every weight, merged (fp32; a tied head is the embeddings' tensor, loaded once).
    config, state_dict, _ = tiny
    whole = sum(t.numel() * 4 for k, t in state_dict.items() if not (config.tie_word_embeddings and k == "lm_head.weight"))
    assert [record["refit/bytes"] for record in straight] == [whole, whole]

    # The checkpoint holds the adapters and their Adam states, not the frozen base weights.
    from megatron.core.dist_checkpointing import load_tensors_metadata

    step1 = out / "checkpoints" / "step_000001"
    saved = {key for key in load_tensors_metadata(str(step1 / "policy")) if not key.startswith("optimizer.")}
    # (megatron-core stacks the layers of one parameter into one checkpoint tensor)
    assert saved == {f"decoder.layers.{module}.{factor}" for module in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
                                    "mlp.linear_fc2") for factor in ("lora_A", "lora_B")}

    # hf_checkpoint holds the merged weights and, in adapter/, the adapters that peft puts on the base model.
    merged = AutoModelForCausalLM.from_pretrained(out / "hf_checkpoint").eval()
    peft_model = PeftModel.from_pretrained(build_hf_model(tiny[0], tiny[1]), out / "hf_checkpoint" / "adapter").eval()
    ids = torch.tensor([[5, 17, 42, 7, 99, 3]])
    with torch.no_grad():
        expected, got = merged(ids).logits, peft_model(ids).logits
    assert float((got - expected).abs().max() / expected.abs().max()) < 1e-5

    resumed = run(monkeypatch, out, [*LORA, f"trainer.resume={step1}"], checkpoint=tiny)
    assert untimed(resumed[-1]) == untimed(straight[-1])

    # Resumed onto other base weights (one element changed), the adapters are refused before loading.
    tokenizer = tiny[2]
    other = dict(state_dict, **{"model.norm.weight": state_dict["model.norm.weight"].clone()})
    other["model.norm.weight"][0] += 1.0
    with pytest.raises(ValueError, match=r"(?s)trainer.resume: checkpoint .* another config:.*base weights under "
                                         r"the adapters \(model.source='tiny-random-llama'\): checksum"):
        run(monkeypatch, out, [*LORA, f"trainer.resume={step1}"], checkpoint=(config, other, tokenizer))
