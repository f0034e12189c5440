"""Benchmark: one optimizer step of a small Qwen2-shaped policy with the real 151,936-token vocabulary
on long-tailed response lengths, for four ways of running the batch (CPU, one process).

    OMP_NUM_THREADS=1 python benchmarks/train_step.py [--rows 16] [--cap 384] [--hidden 128]

(a) ``padded``: fixed micro-batches of ``--micro`` rows padded to the batch's longest row, Megatron's
    output layer computes the logits ``[b, S, V]`` at every position (the old default);
(b) ``budget``: token-budget micro-batches (rows grouped by length, each padded to its own longest);
(c) ``packed``: sequences end to end in rows of ``--max-tokens`` positions;
(d) ``packed+fused``: (c) with the output layer fused into the loss (log-probs and entropies from
    the hidden states, ``--chunk`` tokens at a time).

Each variant runs in its own process (so that peak memory is its own): the step is
``compute_old_logprobs`` (forward only) then one ``train_on_batch`` (forward + backward + Adam) with
the GRPO loss. Reported: wall time of the step, peak extra resident memory during it (``ru_maxrss``
after minus before), tokens the model computed (all positions of all rows it ran) vs tokens the
loss reads (response targets), and the loss (identical across variants up to float rounding). The
lengths follow a scaled-down version of the paper's regime: most responses short, a few at the cap
(75% uniform in [16, cap/6], 25% in [cap/2, cap], the longest at the cap). Last line:
``step_time_ratio=<d/a> peak_mem_ratio=<d/a>``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

VARIANTS = {
    "padded": dict(output_chunk_size=None, max_tokens=None, pack=False),
    "budget": dict(output_chunk_size=None, max_tokens="budget", pack=False),
    "packed": dict(output_chunk_size=None, max_tokens="row", pack=True),
    "packed+fused": dict(output_chunk_size="chunk", max_tokens="row", pack=True),
}


def _lengths(rows: int, cap: int, seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    short = torch.randint(16, max(17, cap // 6), (rows,), generator=gen)
    long = torch.randint(cap // 2, cap + 1, (rows,), generator=gen)
    lengths = torch.where(torch.rand(rows, generator=gen) < 0.25, long, short)
    lengths[0] = cap
    return lengths


def _batch(args, vocab: int):
    import torch

    from nemo_sspo.algorithms.batch import pack_rollouts

    gen = torch.Generator().manual_seed(args.seed + 1)
    lengths = _lengths(args.rows, args.cap, args.seed)
    prompt = torch.randint(3, vocab, (args.rows, args.prompt), generator=gen)
    responses = torch.randint(3, vocab, (args.rows, args.cap), generator=gen)
    response_mask = torch.arange(args.cap)[None, :] < lengths[:, None]
    advantages = torch.randn(args.rows, generator=gen)
    segments = torch.where(response_mask, torch.cumsum(response_mask.long(), 1) - 1, -1)
    return pack_rollouts(prompt, torch.ones_like(prompt, dtype=torch.bool), responses, response_mask,
                         segments, advantages, pad_id=0)


def _run_variant(args) -> dict:
    """One variant in this process: returns its measurements."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from nemo_sspo.algorithms.losses import GRPOLossConfig, make_policy_loss
    from nemo_sspo.algorithms.micro_batches import MicroBatchLayout
    from nemo_sspo.megatron import build_policy_model, initialize_parallel, load_hf_into_megatron, vocab_shard
    from nemo_sspo.megatron.step import LossSpec
    from nemo_sspo.megatron.training import compute_old_logprobs, train_on_batch, wrap_for_training

    option = VARIANTS[args.variant]
    config = Qwen2Config(vocab_size=151936, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    state = Qwen2ForCausalLM(config).state_dict()
    initialize_parallel(tp_size=1, pp_size=1, seed=0)
    model = build_policy_model(config)
    load_hf_into_megatron(model, state, config)
    del state
    ddp, optimizer = wrap_for_training(model, lr=1e-5, weight_decay=0.0, adam_beta1=0.9,
                                       adam_beta2=0.999, adam_eps=1e-8, clip_grad=0.0)
    batch = _batch(args, config.vocab_size)
    max_tokens = {"budget": args.micro * int(batch.lengths.float().mean() * 1.5),
                  "row": args.max_tokens, None: None}[option["max_tokens"]]
    max_tokens = max(max_tokens, int(batch.lengths.max())) if max_tokens else None
    layout = MicroBatchLayout(micro_batch_size=None if max_tokens else args.micro,
                              max_tokens=max_tokens, pack=option["pack"])
    vocab_start, vocab_size = vocab_shard(model)
    spec = LossSpec(loss=make_policy_loss("grpo", GRPOLossConfig()), tp_group=None,
                    vocab_start=vocab_start, vocab_size=vocab_size, temperature=1.0,
                    max_response_length=args.cap,
                    output_chunk_size=args.chunk if option["output_chunk_size"] else None)
    computed = sum(m.input_ids.numel() for m in layout.plan(batch))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    scored = compute_old_logprobs(ddp, batch, spec, layout, dp_group=None)  # one process
    scored.old_logprobs += 0.01 * torch.randn(scored.old_logprobs.shape) * scored.loss_mask
    sums, _ = train_on_batch(ddp, optimizer, scored, spec, layout, dp_group=None)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    loss = float(sums["loss/policy"].total / sums["loss/policy"].count)
    return {"variant": args.variant, "seconds": seconds, "peak_mib": peak / 1024,
            "tokens_computed": computed, "tokens_used": int(batch.loss_mask.sum()), "loss": loss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=16, help="responses in the step")
    parser.add_argument("--cap", type=int, default=384, help="longest response (tokens)")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per row")
    parser.add_argument("--micro", type=int, default=4, help="rows per micro-batch of (a)")
    parser.add_argument("--max-tokens", type=int, default=1024, help="packed row width of (c), (d)")
    parser.add_argument("--chunk", type=int, default=128, help="tokens per chunk of (d) (parallel.output_chunk_size)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(_run_variant(args)))
        return
    results = {}
    for variant in VARIANTS:
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--variant", variant],
                             capture_output=True, text=True, env=os.environ, check=True)
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{'variant':<14} {'step s':>8} {'peak MiB':>9} {'tokens computed':>16} {'tokens used':>12} {'loss':>12}")
    for r in results.values():
        print(f"{r['variant']:<14} {r['seconds']:8.2f} {r['peak_mib']:9.0f} {r['tokens_computed']:16d} "
              f"{r['tokens_used']:12d} {r['loss']:12.7f}")
    base, best = results["padded"], results["packed+fused"]
    print(f"step_time_ratio={best['seconds'] / base['seconds']:.3f} "
          f"peak_mem_ratio={best['peak_mib'] / max(base['peak_mib'], 1e-9):.3f}")


if __name__ == "__main__":
    main()
