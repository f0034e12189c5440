"""GPU checks of the device-resident refit, driven by tests/gpu/run_checks.sh (group ``refit``).

    python tests/gpu/refit_checks.py device MODEL_DIR          # one GPU: export -> buckets -> HF engine, on device
    torchrun --nproc-per-node=2 tests/gpu/refit_checks.py nccl # 2+ GPUs: the refit broadcast over NCCL
    python tests/gpu/refit_checks.py dry-run MODEL_DIR         # CPU: imports and the settings' configs

``device``: a bf16 Megatron policy (local spec, random weights at MODEL_DIR's shape) exports its HF
buckets on the GPU (``iter_hf_weight_buckets``, 64 MiB), which are encoded for a one-member NCCL
refit group and for a one-member gloo group (the wire format of ``weight_broadcast``), decoded, and
loaded into a bf16 HF engine on the same GPU with ``rollout.refit.verify``'s check. Passes when over
NCCL the payload stays on the GPU and ``bytes_to_host`` is 0 (gloo: every weight byte), every bucket
verifies, and the engine's weights equal the export; prints seconds per GB of each path. Then the
trainer/engine log-prob gap with ``model.output_layer_precision`` auto and fp32: the HF engine's
sampled-token log-probs against the fused output layer's from the same model's final hidden states.

``nccl``: world rank 0 (training) broadcasts 1 GiB of bf16 buckets to world rank 1 (rollout) over the
split world's NCCL refit group; the receiver checks every tensor bit for bit on its GPU and the
stream's version; ``bytes_to_host`` 0; seconds per GB printed. SKIP with fewer than 2 GPUs.

Prints ``PASS`` / ``FAIL`` / ``SKIP`` lines as tests/gpu/gpu_checks.py; not a pytest module. Not run on a
GPU yet (none was lent to the session that wrote it).
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_checks import PROMPTS, TEMPERATURE, report, shape_checkpoint  # noqa: E402

NCCL_BUCKETS, NCCL_BUCKET_ELEMENTS = 16, 32 << 20  # 16 x 64 MiB of bf16 = 1 GiB


def _payload_paths(buckets, engine):
    """Each export bucket through the wire encoding on the NCCL group's device and on gloo's (the host),
    decoded and loaded into ``engine`` with the refit check. Returns ``(seconds, bytes to host, every
    payload where expected, buckets verified)``; the transport itself is the ``nccl`` check's.
    """
    from nemo_sspo.parallel.weight_broadcast import _decode, _encode
    from nemo_sspo.rollout.refit_check import load_verified

    timings, to_host, on_gpu = {}, {}, True
    for path, device in (("nccl", torch.device("cuda", torch.cuda.current_device())), ("gloo", torch.device("cpu"))):
        torch.cuda.synchronize()
        start, copied = time.perf_counter(), 0

        def decoded(path=path, device=device):
            nonlocal copied, on_gpu
            for bucket in buckets:
                (_, table, names, payload), moved = _encode(bucket, device)
                copied += moved
                on_gpu &= payload.is_cuda == (path == "nccl")
                yield _decode(table, names, payload)  # gloo: host views, copied to the GPU by the load

        verified = load_verified(engine, decoded(), step=1)
        torch.cuda.synchronize()
        timings[path], to_host[path] = time.perf_counter() - start, copied
    return timings, to_host, on_gpu, verified


def check_device(model_dir: str) -> None:
    """The ``device`` check (module docstring)."""
    from nemo_sspo.megatron import (build_policy_model, destroy_parallel, initialize_parallel, iter_hf_weight_buckets,
                                    load_hf_into_megatron)
    from nemo_sspo.models import build_hf_model
    from nemo_sspo.rollout import HFRolloutEngine

    config, state_dict, tokenizer = shape_checkpoint(model_dir)
    initialize_parallel(tp_size=1, pp_size=1, seed=0)
    try:
        megatron = build_policy_model(config, precision="bf16", transformer_impl="local")
        load_hf_into_megatron(megatron, state_dict, config)
        export = [dict(b) for b in iter_hf_weight_buckets(megatron, config, 64 << 20)]
        weight_bytes = sum(t.numel() * t.element_size() for b in export for t in b.values())
        engine = HFRolloutEngine(build_hf_model(config, state_dict).to(torch.bfloat16), tokenizer, max_new_tokens=32,
                                 temperature=TEMPERATURE, device="cuda")
        timings, to_host, on_gpu, verified = _payload_paths(export, engine)
        held = engine.read_weights([n for b in export for n in b])
        equal = all(torch.equal(held[n], t) for b in export for n, t in b.items())
        gb = weight_bytes / 1e9
        report("device refit", on_gpu and to_host["nccl"] == 0 and to_host["gloo"] == weight_bytes
               and verified == len(export) and equal,
               f"{torch.cuda.get_device_name()}, {len(export)} buckets, {gb:.3f} GB bf16 on the GPU: device path "
               f"{timings['nccl'] / gb:.3f} s/GB with bytes_to_host {to_host['nccl']}, host path "
               f"{timings['gloo'] / gb:.3f} s/GB with bytes_to_host {to_host['gloo']} (encode + decode + load + "
               f"verify, one member: no transfer); {verified} buckets verified, engine == export: {equal}")
        _output_precision_gap(megatron, config, state_dict, tokenizer)
    finally:
        destroy_parallel()


def _output_precision_gap(megatron, config, state_dict, tokenizer) -> None:
    """Mean |engine log-prob - fused-path log-prob| of the sampled tokens, head auto vs fp32 on both sides."""
    from nemo_sspo.models import build_hf_model
    from nemo_sspo.parallel import fused_linear_logprobs_entropy
    from nemo_sspo.rollout import HFRolloutEngine

    gaps = {}
    for precision in ("auto", "fp32"):
        model = build_hf_model(config, state_dict).to(torch.bfloat16)
        engine = HFRolloutEngine(model, tokenizer, max_new_tokens=64, temperature=TEMPERATURE, device="cuda",
                                 output_layer_precision=precision)
        batch = engine.generate(PROMPTS, seed=3)
        ids = torch.cat([batch.prompt_ids, batch.response_ids], 1).cuda()
        mask = torch.cat([batch.prompt_mask, batch.response_mask], 1).cuda()
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            hidden = engine.model.model(input_ids=ids, attention_mask=mask.long(), position_ids=positions)[0]
        p = batch.prompt_ids.shape[1]
        rows = hidden[:, p - 1:-1][batch.response_mask.cuda()]
        weight = engine.model.get_output_embeddings().weight
        trainer, _ = fused_linear_logprobs_entropy(rows, weight, batch.response_ids.cuda()[batch.response_mask.cuda()],
                                                   tp_group=None, vocab_start=0, vocab_size=config.vocab_size,
                                                   temperature=TEMPERATURE, chunk_size=1024, precision=precision)
        gaps[precision] = float((trainer.cpu() - batch.rollout_logprobs[batch.response_mask]).abs().mean())
    report("output layer precision gap", gaps["fp32"] <= gaps["auto"],
           f"mean |engine - trainer| log-prob of the sampled tokens, bf16 model: head auto {gaps['auto']:.5f}, "
           f"fp32 {gaps['fp32']:.5f} (HF generate against the fused output layer on the same hidden states' model)")


def check_nccl() -> None:
    """The ``nccl`` check (module docstring); run under torchrun with 2 processes."""
    from nemo_sspo.parallel.world_split import split_launched_world
    from nemo_sspo.parallel.weight_broadcast import receive_weight_buckets, send_weight_buckets

    if torch.cuda.device_count() < 2:
        print(f"SKIP nccl refit: {torch.cuda.device_count()} GPU(s) visible, the NCCL broadcast needs 2", flush=True)
        return
    split = split_launched_world(1, timeout=datetime.timedelta(seconds=120), device_refit=True)
    if split.refit.name() != "nccl":
        report("nccl refit", False, f"the refit group is {split.refit.name()}, expected nccl")
        return

    def bucket(i: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator(device="cuda").manual_seed(i)
        return {f"w{i}": torch.randn(NCCL_BUCKET_ELEMENTS, generator=gen, device="cuda").bfloat16()}

    if not split.is_rollout:
        torch.cuda.synchronize()
        stats = send_weight_buckets((bucket(i) for i in range(NCCL_BUCKETS)), group=split.refit, receivers=[1],
                                    version=5)
        report("nccl refit send", stats.bytes_to_host == 0 and stats.buckets == NCCL_BUCKETS,
               f"{stats.bytes / 1e9:.3f} GB in {stats.buckets} buckets, {stats.seconds_per_gb:.4f} s/GB "
               f"(generation of the random buckets included), bytes_to_host {stats.bytes_to_host}")
        return
    end, equal, on_gpu = {}, True, True

    def stream():
        end["version"] = yield from receive_weight_buckets(group=split.refit)

    for i, got in enumerate(stream()):
        on_gpu &= all(t.is_cuda for t in got.values())
        equal &= all(torch.equal(t, bucket(i)[name]) for name, t in got.items())
    report("nccl refit receive", equal and on_gpu and end["version"] == 5,
           f"every bucket on the GPU: {on_gpu}, bit for bit: {equal}, version {end['version']}")


def check_dry_run(model_dir: str) -> None:
    """CPU: the modules import, and configs with the settings these checks cover load."""
    from nemo_sspo.cli import load_config
    from nemo_sspo.parallel.world_split import split_launched_world  # noqa: F401
    from nemo_sspo.rollout.refit_check import load_verified  # noqa: F401

    cfg = load_config(overrides=[f"model.source={model_dir}", "model.precision=bf16", "rollout.refit.verify=true",
                                 "model.output_layer_precision=fp32"])
    report("refit dry run", cfg.rollout.refit.verify and cfg.model.output_layer_precision == "fp32",
           "imports fine; a config with rollout.refit.verify and model.output_layer_precision=fp32 loads; "
           "nothing ran on a GPU")


def main() -> int:
    import gpu_checks

    return gpu_checks.run_command({"device": check_device, "nccl": check_nccl, "dry-run": check_dry_run}, __doc__)


if __name__ == "__main__":
    sys.exit(main())
