"""GPU checks driven by tests/gpu/run_checks.sh (NOT RUN YET: written without a GPU; see that script's header).

    python tests/gpu/gpu_checks.py vllm                   # bf16 vLLM: gap, streamed refit, sleep / wake
    python tests/gpu/gpu_checks.py metrics DIR MAX_GAP    # a finished `nemo-sspo train` run's metrics.jsonl
    python tests/gpu/gpu_checks.py packed                 # TE THD packed row vs the same rows padded

Prints ``PASS name: numbers`` / ``FAIL name: why`` lines; exits 1 when any check failed. Not a pytest
module (no ``test_`` prefix): it needs a CUDA GPU and runs only through the script.
"""

from __future__ import annotations

import json
import math
import sys
import traceback
from pathlib import Path

import torch

SOURCE = "smollm2-135m-instruct"
TEMPERATURE = 0.7
PROMPTS = ["Tom has 3 apples and buys 5 more. How many apples does he have?", "What is 12 * 7?",
           " ".join(f"Line {i}: Sam has {i % 7} stamps and buys {i % 5} more." for i in range(14))]
_FAILED: list[str] = []


def report(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        _FAILED.append(name)


def reference_logprobs(model, batch) -> torch.Tensor:
    """``[B, T]`` log-softmax(logits / T) at the sampled ids from a transformers model on the GPU, 0 off the mask."""
    device = model.device
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1).to(device)
    mask = torch.cat([batch.prompt_mask, batch.response_mask], 1).to(device)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=positions).logits.float()
    prompt_len = batch.prompt_ids.shape[1]
    logprobs = torch.log_softmax(logits[:, prompt_len - 1:-1] / TEMPERATURE, -1)
    logprobs = logprobs.gather(-1, batch.response_ids.to(device).unsqueeze(-1)).squeeze(-1).cpu()
    return torch.where(batch.response_mask, logprobs, 0.0)


def gap(engine, model, seed: int = 1) -> tuple[float, float]:
    """(mean, max) |vLLM log-prob - transformers fp32 log-prob| over the sampled tokens."""
    batch = engine.generate(PROMPTS, seed=seed)
    diff = (batch.rollout_logprobs - reference_logprobs(model, batch)).abs()[batch.response_mask]
    return float(diff.mean()), float(diff.max())


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]  # device-wide: vLLM's sleep-mode pool is outside torch's allocator


def streamed_refit(engine, config, state_dict) -> int:
    """The trainer's refit path on one GPU: Megatron (TP=1, PP=1, fp32) -> iter_hf_weight_buckets (16 MiB
    buckets of whole layers) -> VLLMRolloutEngine.load_weight_buckets. Returns the bucket count."""
    from nemo_sspo.megatron import (build_policy_model, destroy_parallel, initialize_parallel, iter_hf_weight_buckets,
                                    load_hf_into_megatron)

    initialize_parallel(tp_size=1, pp_size=1, seed=0)
    try:
        megatron = build_policy_model(config)
        load_hf_into_megatron(megatron, state_dict, config)
        count = 0

        def counted():
            nonlocal count
            for bucket in iter_hf_weight_buckets(megatron, config, 16 << 20):
                count += 1
                yield bucket

        engine.load_weight_buckets(counted())
        return count
    finally:
        destroy_parallel()


def check_vllm() -> None:
    from nemo_sspo.models import build_hf_model, load_hf_checkpoint
    from nemo_sspo.models.hf_checkpoint import engine_model_dir
    from nemo_sspo.rollout import VLLMRolloutEngine
    from nemo_sspo.trainer.config import VLLMConfig

    config, state_dict, tokenizer = load_hf_checkpoint(SOURCE)
    before_build = free_bytes()
    engine = VLLMRolloutEngine.build(
        engine_model_dir(SOURCE), tokenizer, seed=0, max_new_tokens=64, temperature=TEMPERATURE,
        vllm_config=VLLMConfig(gpu_memory_utilization=0.3, enforce_eager=True, max_model_len=1024,
                               enable_sleep_mode=True))
    used = before_build - free_bytes()
    model = build_hf_model(config, {k: v.clone() for k, v in state_dict.items()}).cuda().eval()
    mean, worst = gap(engine, model)
    # bf16 vLLM kernels vs fp32 transformers: a few 1e-2 expected on average
    report("vllm bf16 log-prob gap", mean < 0.05, f"mean {mean:.2e}, max {worst:.2e} (limit mean < 5e-2)")

    generator = torch.Generator().manual_seed(3)
    moved = {k: v + 0.01 * torch.randn(v.shape, generator=generator) for k, v in state_dict.items()
             if k != "lm_head.weight"}
    moved_model = build_hf_model(config, moved).cuda().eval()
    stale, _ = gap(engine, moved_model)
    buckets = streamed_refit(engine, config, moved)
    after, after_max = gap(engine, moved_model)
    report("vllm streamed refit", after < 0.05 and stale > 3 * after,
           f"{buckets} buckets; gap to the new weights: stale {stale:.2e}, after refit {after:.2e} "
           f"(max {after_max:.2e}); limits after < 5e-2 and stale > 3x after")

    awake = engine.generate(PROMPTS, seed=7)
    free_awake = free_bytes()
    engine.sleep()
    released = free_bytes() - free_awake
    report("vllm sleep(level=1)", released >= 0.8 * used,
           f"engine took {used / 2**30:.2f} GiB, sleep released {released / 2**30:.2f} GiB (limit >= 80%)")
    woken = engine.generate(PROMPTS, seed=7)  # wakes the engine first
    back = free_awake - free_bytes()
    same_ids = torch.equal(awake.response_ids, woken.response_ids)
    diff = float((awake.rollout_logprobs - woken.rollout_logprobs).abs().max())
    report("vllm wake_up", same_ids and diff <= 1e-3 and abs(back) < 0.1 * used,
           f"same samples {same_ids}, max log-prob change {diff:.2e} (limit 1e-3), memory back within "
           f"{back / 2**30:+.2f} GiB of awake")


PACKED_LENGTHS = [37, 120, 5, 64, 201]
"""Sequences of the packed check: 427 tokens, not a multiple of 16, so the 16-aligned row pads."""


def _next_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[L - 1]`` fp32 log-probs of ``ids[1:]`` from one sequence's hidden states ``[L, H]`` (the
    output layer in fp32, so its bf16 rounding does not hide or fake a difference)."""
    logits = hidden[:-1].float() @ weight.float().T
    return torch.log_softmax(logits, -1).gather(-1, ids[1:, None]).squeeze(-1)


def check_packed() -> None:
    """BF16 SmolLM2-135M, TransformerEngine spec: the packed THD row gives the log-probs of the same
    sequences right-padded in a [K, L_max] batch (causal TE attention, no packing), within bf16
    noise; the noise floor printed is each sequence alone vs padded (the same kernels, other shapes).
    Then the row padded to 16 tokens (the FP8 alignment, filler joined to the last sequence), and an
    FP8 (hybrid, delayed) forward + backward on the packed row: finite, and TE accepts the shapes."""
    from nemo_sspo.megatron import (build_policy_model, destroy_parallel, initialize_parallel,
                                    load_hf_into_megatron)
    from nemo_sspo.megatron import model as model_module
    from nemo_sspo.megatron.model import forward_hidden, output_weight
    from nemo_sspo.megatron.packed_seq import padded_width, thd_alignment
    from nemo_sspo.models import load_hf_checkpoint

    config, state_dict, _ = load_hf_checkpoint(SOURCE)
    generator = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=generator).cuda() for n in PACKED_LENGTHS]
    lengths = torch.tensor(PACKED_LENGTHS).cuda()
    row = torch.cat(seqs)[None, :]
    positions = torch.arange(row.shape[1]).cuda()[None, :]
    initialize_parallel(tp_size=1, pp_size=1, seed=0)
    try:
        model = build_policy_model(config, precision="bf16", transformer_impl="transformer_engine").eval()
        load_hf_into_megatron(model, state_dict, config)
        weight = output_weight(model)
        width = max(PACKED_LENGTHS)
        padded = torch.zeros(len(seqs), width, dtype=torch.long, device=row.device)
        for b, seq in enumerate(seqs):
            padded[b, :len(seq)] = seq
        with torch.no_grad():
            batch_hidden = forward_hidden(model, padded, torch.arange(width).cuda().expand_as(padded))
            reference = [_next_token_logprobs(batch_hidden[b, :len(s)], weight, s) for b, s in enumerate(seqs)]
            alone = [_next_token_logprobs(forward_hidden(model, s[None], torch.arange(len(s)).cuda()[None])[0],
                                          weight, s) for s in seqs]
            floor = max(float((a - r).abs().max()) for a, r in zip(alone, reference))
            # bf16 activations: kernel/shape changes move log-probs by ~1e-2 at most; a mask or RoPE
            # error moves them by O(1). The limit: 2e-2, or twice the measured noise floor if larger.
            limit = max(2e-2, 2 * floor)
            for alignment in (1, 16):
                saved = model_module.thd_alignment
                model_module.thd_alignment = lambda cfg, a=alignment: a
                try:
                    hidden = forward_hidden(model, row, positions, sequence_lengths=lengths)[0]
                finally:
                    model_module.thd_alignment = saved
                packed = [_next_token_logprobs(h, weight, s)
                          for h, s in zip(hidden.split(PACKED_LENGTHS), seqs)]
                diff = torch.cat([(p - r).abs() for p, r in zip(packed, reference)])
                report(f"packed thd vs padded (row aligned to {alignment})", float(diff.max()) < limit,
                       f"max |log-prob diff| {float(diff.max()):.2e}, mean {float(diff.mean()):.2e} over "
                       f"{diff.numel()} tokens; alone-vs-padded noise floor {floor:.2e} (limit max < {limit:.1e})")
        del model
        fp8 = build_policy_model(config, precision="bf16", fp8="hybrid", fp8_recipe="delayed",
                                 transformer_impl="transformer_engine").train()
        load_hf_into_megatron(fp8, state_dict, config)
        hidden = forward_hidden(fp8, row, positions, sequence_lengths=lengths)
        hidden.float().pow(2).mean().backward()
        grads = [p.grad for p in fp8.parameters() if p.grad is not None]
        finite = bool(torch.isfinite(hidden).all()) and all(bool(torch.isfinite(g).all()) for g in grads)
        shape_ok = tuple(hidden.shape) == (1, row.shape[1], config.hidden_size)
        report("packed thd fp8 forward+backward", finite and shape_ok,
               f"row of {row.shape[1]} tokens run as {padded_width(row.shape[1], thd_alignment(fp8.config))}; "
               f"output {tuple(hidden.shape)}, "
               f"{len(grads)} parameter grads, all finite: {finite}")
    finally:
        destroy_parallel()


def check_metrics(run_dir: str, max_gap: float) -> None:
    """A 2-step run: finite policy loss, grad norm > 0 and the trainer-vs-rollout mean log-prob gap."""
    path = Path(run_dir) / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    report("run finished", len(records) >= 2, f"{len(records)} step records in {path}")
    for record in records:
        loss, norm = record.get("loss/policy", math.nan), record.get("optim/grad_norm", math.nan)
        run_gap = record.get("rollout/trainer_logprob_gap_abs", math.nan)
        report(f"step {record['step']}", math.isfinite(loss) and norm > 0 and run_gap < max_gap,
               f"loss/policy {loss:.4g}, grad norm {norm:.3g}, trainer-vs-rollout mean |gap| {run_gap:.2e} "
               f"(limit {max_gap:g})")


def main() -> int:
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    try:
        if command == "vllm":
            check_vllm()
        elif command == "packed":
            check_packed()
        elif command == "metrics":
            check_metrics(sys.argv[2], float(sys.argv[3]))
        else:
            print(__doc__)
            return 2
    except Exception:  # noqa: BLE001 - reported as a failed check with its traceback
        traceback.print_exc()
        report(command, False, "raised (traceback above)")
    return 1 if _FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
