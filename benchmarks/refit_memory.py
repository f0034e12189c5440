"""Benchmark: peak memory of the refit export, full gather vs streamed buckets (CPU, gloo).

    OMP_NUM_THREADS=1 python benchmarks/refit_memory.py [--bucket-mb 256] [--layouts tp2 pp2]

A Llama-shaped random model (default 1024 hidden, 12 layers, FFN 2816, 16 heads / 4 KV heads,
32,000 vocabulary, untied head: 201M parameters, 805 MB in fp32) is built as Megatron GPTModel
stages in 2 gloo processes per layout (TP=2, or PP=2), and each rank measures:

- ``full``: ``export_hf_state_dict(model, hf_config)``, the whole HF state dict on every rank (what
  the trainer's refit gathered before streaming; checkpoints and tests still use it).
- ``streamed``: ``iter_hf_weight_buckets(model, hf_config, bucket_mb << 20)``, each bucket released
  before the next is taken (as the engines' ``load_weight_buckets`` do); buckets reach only the
  replica's engine rank (rank 0 here).

Peak: bytes of live tensor storages created during the call (``LiveBytes`` of
benchmarks/vocab_parallel.py, a TorchDispatchMode with weak references on storages; torch has no
CPU allocator statistics; gloo's internal buffers are not tensors and are not counted). The model's
own parameters exist before the call and are not counted. The last line is
``refit_peak_ratio=<streamed / full, worst rank of the worst layout>``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import time

import torch
import torch.distributed as dist

from vocab_parallel import LiveBytes, run_ranks  # benchmarks/ is the script's directory, first on sys.path

_MB = 1 << 20
_LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}


def _hf_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
                       num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                       tie_word_embeddings=False, max_position_embeddings=256)


def _measure(call) -> tuple[int, float]:
    """``(peak bytes of storages created during call(), seconds)``."""
    gc.collect()
    start = time.perf_counter()
    with LiveBytes() as tracker:
        call()
    return tracker.peak, time.perf_counter() - start


def _worker(rank, port, queue, tp, pp, args):
    from nemo_sspo.megatron import (build_policy_model, destroy_parallel, export_hf_state_dict,
                                    initialize_parallel, iter_hf_weight_buckets)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(tp * pp))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=tp * pp, timeout=datetime.timedelta(seconds=900))
    initialize_parallel(tp_size=tp, pp_size=pp, seed=0)
    hf_config = _hf_config(args)
    model = build_policy_model(hf_config).eval()
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    buckets = []

    def full():
        state = export_hf_state_dict(model, hf_config)
        del state

    def streamed():
        for bucket in iter_hf_weight_buckets(model, hf_config, args.bucket_mb * _MB):
            buckets.append(sum(t.numel() * t.element_size() for n, t in bucket.items()))
            del bucket

    with torch.no_grad():
        full_peak, full_s = _measure(full)
        streamed_peak, streamed_s = _measure(streamed)
    row = dict(layout=f"TP={tp} PP={pp}", rank=rank, role="engine" if rank == 0 else "other", shard=shard,
               full=full_peak, streamed=streamed_peak, full_s=full_s, streamed_s=streamed_s, buckets=buckets)
    rows = [None] * (tp * pp)
    dist.all_gather_object(rows, row)
    if rank == 0:
        queue.put(rows)
    destroy_parallel()
    dist.destroy_process_group()


def _run_layout(tp, pp, args):
    return run_ranks(tp * pp, _worker, tp, pp, args)


def _print_rows(rows) -> None:
    print(f"{'layout':<10} {'rank':>4} {'role':<7} {'shard MB':>9} {'full peak MB':>13} {'streamed peak MB':>17} "
          f"{'ratio':>6} {'full s':>7} {'streamed s':>11}")
    for r in rows:
        print(f"{r['layout']:<10} {r['rank']:>4} {r['role']:<7} {r['shard'] / _MB:>9.1f} {r['full'] / _MB:>13.1f} "
              f"{r['streamed'] / _MB:>17.1f} {r['streamed'] / r['full']:>6.3f} {r['full_s']:>7.2f} "
              f"{r['streamed_s']:>11.2f}")
    for r in rows:
        if r["buckets"]:
            sizes = ", ".join(f"{b / _MB:.0f}" for b in r["buckets"])
            print(f"{r['layout']}: {len(r['buckets'])} buckets on rank {r['rank']} (MB): {sizes}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket-mb", type=int, default=256, help="rollout.refit.bucket_mb (default 256)")
    parser.add_argument("--layouts", nargs="+", default=list(_LAYOUTS), choices=sorted(_LAYOUTS))
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    rows = [row for name in args.layouts for row in _run_layout(*_LAYOUTS[name], args)]
    total = sum(r["shard"] for r in rows if r["layout"] == rows[0]["layout"])
    print(f"model: {args.layers} layers, hidden {args.hidden}, FFN {args.ffn}, vocab {args.vocab}, fp32 "
          f"(padded vocab included): {total / _MB:.0f} MB over the ranks of one layout; bucket {args.bucket_mb} MB")
    _print_rows(rows)
    ratios = [max(r["streamed"] for r in rows if r["layout"] == lay) / max(r["full"] for r in rows if r["layout"] == lay)
              for lay in dict.fromkeys(r["layout"] for r in rows)]
    print(f"refit_peak_ratio={max(ratios):.3f}")


if __name__ == "__main__":
    main()
