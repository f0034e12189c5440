"""Benchmark: LoRA against full fine-tuning on one model, measured in one run (CPU, one gloo process).

    OMP_NUM_THREADS=1 python benchmarks/lora.py [--hidden 256] [--layers 4] [--seq 256] [--rank 8] [--repeats 5]

A Llama-shaped random model (default hidden 256, 4 layers, SwiGLU 688, 8 heads / 2 KV heads,
vocabulary 1,000, untied head; the model of ``benchmarks/memory.py``), fp32, local spec, built twice:
every weight trained, and frozen with rank ``--rank`` adapters on all four linear layers of every
decoder layer (``model.lora``). For each:

- trained parameters, and the optimizer's bytes on the rank (Adam ``exp_avg`` / ``exp_avg_sq``;
  ``tests/unit/_memory_cases.counted_state_bytes``) with the gradient buffer's;
- step time: forward + backward of two rows of ``--seq`` tokens and one Adam step, median of
  ``--repeats`` after one warm-up;
- refit: the bytes and seconds of the merged export every refit streams
  (``iter_hf_weight_buckets``: the whole model either way, adapters merged into their weights) and,
  for LoRA, of the adapters alone (``export_hf_adapters``: what ``model.lora.refit=adapters`` moves).

The last lines are ratios LoRA / full.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository (tests/unit/_memory_cases.py)

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def _measure(args, config, lora) -> dict:
    from nemo_sspo.megatron import build_policy_model, cpu_device_context, forward_hidden
    from nemo_sspo.megatron.hf_mapping import export_hf_adapters, iter_hf_weight_buckets
    from nemo_sspo.megatron.training import wrap_for_training
    from tests.unit._memory_cases import counted_state_bytes

    torch.manual_seed(0)
    model = build_policy_model(config, lora=lora).train()
    ddp, optimizer = wrap_for_training(model, lr=1e-4, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
                                       adam_eps=1e-8, clip_grad=1.0)
    ids = torch.randint(0, config.vocab_size, (2, args.seq), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(args.seq).expand(2, args.seq)
    times = []
    for _ in range(args.repeats + 1):
        start = time.perf_counter()
        with cpu_device_context():
            forward_hidden(ddp, ids, positions).pow(2).mean().backward()
            ddp.finish_grad_sync()
            optimizer.step()
        optimizer.zero_grad()
        ddp.zero_grad_buffer()
        times.append(time.perf_counter() - start)
    counted = counted_state_bytes(ddp, optimizer)
    start = time.perf_counter()
    refit = sum(t.numel() * t.element_size() for bucket in iter_hf_weight_buckets(model, config, 1 << 30)
                for t in bucket.values())
    refit_s = time.perf_counter() - start
    row = dict(trained=sum(p.numel() for p in model.parameters() if p.requires_grad),
               optimizer=counted["optimizer"], gradients=counted["gradients"],
               step_s=statistics.median(times[1:]), refit_bytes=refit, refit_s=refit_s)
    if lora is not None:
        start = time.perf_counter()
        row["adapter_bytes"] = sum(t.numel() * t.element_size() for t in export_hf_adapters(model, config).values())
        row["adapter_s"] = time.perf_counter() - start
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=688)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from nemo_sspo.megatron import destroy_parallel, initialize_parallel
    from nemo_sspo.megatron.lora import LoraSettings
    from tests.unit._memory_cases import llama

    config = llama(hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
                   num_attention_heads=8, num_key_value_heads=2, vocab_size=1000, max_position_embeddings=4 * args.seq)
    initialize_parallel(tp_size=1, pp_size=1, seed=3)
    try:
        full = _measure(args, config, None)
        lora = _measure(args, config, LoraSettings(rank=args.rank, alpha=2.0 * args.rank, dropout=0.0,
                                                   targets=TARGETS))
    finally:
        destroy_parallel()
        dist.destroy_process_group()
    print(f"model: hidden {args.hidden}, {args.layers} layers, SwiGLU {args.ffn}, fp32; LoRA rank {args.rank} on "
          f"{', '.join(TARGETS)}; {args.seq}-token rows x 2; torch threads {torch.get_num_threads()}")
    print(f"{'':<28} {'full fine-tuning':>18} {'LoRA':>14}")
    for key, label in (("trained", "trained parameters"), ("gradients", "gradient bytes"),
                       ("optimizer", "optimizer bytes"), ("refit_bytes", "refit bytes (merged)")):
        print(f"{label:<28} {full[key]:>18,} {lora[key]:>14,}")
    print(f"{'step time (ms)':<28} {1000 * full['step_s']:>18.1f} {1000 * lora['step_s']:>14.1f}")
    print(f"{'refit export (ms)':<28} {1000 * full['refit_s']:>18.1f} {1000 * lora['refit_s']:>14.1f}")
    print(f"{'adapters alone (bytes, ms)':<28} {'-':>18} {lora['adapter_bytes']:>8,} {1000 * lora['adapter_s']:5.1f}")
    print(f"lora_trained_parameter_ratio={lora['trained'] / full['trained']:.4f}")
    print(f"lora_optimizer_bytes_ratio={lora['optimizer'] / full['optimizer']:.4f}")
    print(f"lora_step_time_ratio={lora['step_s'] / full['step_s']:.3f}")
    print(f"lora_merged_refit_bytes_ratio={lora['refit_bytes'] / full['refit_bytes']:.3f}")
    print(f"lora_adapter_only_refit_bytes_ratio={lora['adapter_bytes'] / full['refit_bytes']:.4f}")


if __name__ == "__main__":
    main()
