r"""Record NeMo-RL's own GRPO-family loss on fixed small batches, for tests/integration.

Runs the real host code, so it needs NeMo-RL's source and a venv that imports
``nemo_rl.algorithms.loss`` (NeMo-RL refuses transformers >= 5.12, so not this repository's venv;
docs/integrations.md lists the packages). Writes figures only: the batches, and for each case the
host's config, our equivalent loss config, the host's loss, metrics and gradient with respect to
the logits. No host code is copied into the output.

    PYTHONPATH=/path/to/NeMo-RL:. /path/to/nemorl-venv/bin/python tools/record_nemo_rl.py \
        --host-src /path/to/NeMo-RL --host-commit 7ea279a \
        --out tests/integration/data/nemo_rl_recorded.json

Cases (all through the host's own input preparation, ``prepare_loss_input`` on a one-rank
vocab-parallel gloo group, and its wrappers): GRPO token- and sequence-level, dual clip, DAPO's
clip-higher, GSPO, CISPO, GRPO with a k3 reference KL; one batch split into two micro-batches with the global
``global_valid_*`` counts; packed sequences through ``SequencePackingLossWrapper`` and through
``SequencePackingFusionLossWrapper``. Also recorded: the host's enum values, the keys
``grpo_train`` puts in its training batch (read from the host's ``grpo.py`` source), and our SSPO
adapter (``nemo_sspo.integrations.nemo_rl``) driven by the host's own wrappers on a batch with
exactly those keys, unpacked and packed.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist

ROWS, LENGTH, VOCAB = 4, 9, 12
PROMPT = 3
RESPONSE_LENGTHS = (6, 3, 5, 1)  # tokens after the prompt; row 3 is also masked by sample_mask
NEWLINE_ID = 5  # the toy tokenizer of the SSPO case decodes this id with a newline
PACK_ALIGN = 4  # packed sequences are padded to a multiple of this (cu_seqlens_q_padded)

# name -> (host ClippedPGLossConfig fields, our loss name, our config fields). Host configs set
# reference_policy_kl_penalty=0 unless they say otherwise (its default is 0.01).
CASES = {
    "grpo_token": ({"token_level_loss": True}, "grpo", {"aggregation": "token-mean"}),
    "grpo_sequence": ({"token_level_loss": False}, "grpo",
                      {"aggregation": "seq-mean-token-mean"}),
    "dual_clip": ({"token_level_loss": True, "ratio_clip_c": 3.0}, "grpo",
                  {"aggregation": "token-mean", "dual_clip_c": 3.0}),
    "dapo_clip_higher": ({"token_level_loss": True, "ratio_clip_max": 0.28}, "dapo", {}),
    # GSPO with a clip this batch's sequence ratios fall on both sides of (its default 3e-4/4e-4
    # would clip every sequence here and leave no gradient to compare).
    "gspo": ({"token_level_loss": False, "sequence_level_importance_ratios": True,
              "ratio_clip_min": 0.1, "ratio_clip_max": 0.15}, "gspo",
             {"eps_low": 0.1, "eps_high": 0.15}),
    "cispo": ({"token_level_loss": True, "use_cispo": True, "ratio_clip_min": 1.0,
               "ratio_clip_max": 4.0}, "cispo", {}),
    # The host's k3 reference KL (its default clamps, inactive at these log-ratios) and ours.
    "reference_kl": ({"token_level_loss": True, "reference_policy_kl_penalty": 0.05,
                      "reference_policy_kl_type": "k3"}, "grpo",
                     {"aggregation": "token-mean", "kl_coef": 0.05, "kl_estimator": "k3"}),
}


def _batch(seed: int) -> dict[str, torch.Tensor]:
    """NeMo-RL layout: [B, S] columns aligned with input_ids, prompt then right-padded response."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=gen)
    ids[:, PROMPT:][torch.rand(ROWS, LENGTH - PROMPT, generator=gen) < 0.3] = NEWLINE_ID
    positions = torch.arange(LENGTH)
    lengths = torch.tensor(RESPONSE_LENGTHS)
    token_mask = ((positions >= PROMPT) & (positions < PROMPT + lengths[:, None])).float()
    logits = 1.5 * torch.randn(ROWS, LENGTH, VOCAB, generator=gen)
    logprobs = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    prev = torch.nn.functional.pad(logprobs + 0.8 * torch.randn(logprobs.shape, generator=gen),
                                   (1, 0)) * token_mask
    advantages = torch.randn(ROWS, generator=gen)
    return {
        "input_ids": ids,
        "input_lengths": PROMPT + lengths,
        "token_mask": token_mask,
        "sample_mask": torch.tensor([1.0, 1.0, 1.0, 0.0]),
        "advantages": advantages[:, None].expand(ROWS, LENGTH).contiguous(),
        "prev_logprobs": prev,
        "generation_logprobs": prev + 0.05 * torch.randn(prev.shape, generator=gen) * token_mask,
        "reference_policy_logprobs": prev - 0.4 * torch.rand(prev.shape, generator=gen) * token_mask,
        "logits": logits,
    }


def _global_counts(batch):
    mask = batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]
    return batch["sample_mask"].sum(), mask.sum()


def _data(batch, rows=slice(None)):
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    return BatchedDataDict({k: v[rows] for k, v in batch.items() if k != "logits"})


def _unpacked(loss_fn, batch, micro_batches):
    """The Megatron worker's unpacked path: wrap_loss_fn_with_input_preparation per micro-batch."""
    from nemo_rl.algorithms.loss import prepare_loss_input, wrap_loss_fn_with_input_preparation

    seqs, toks = _global_counts(batch)
    logits = batch["logits"].clone().requires_grad_(True)
    total, metrics = 0.0, []
    for rows in micro_batches:
        loss, mb_metrics = wrap_loss_fn_with_input_preparation(
            logits[rows], _data(batch, rows), seqs, toks, loss_fn=loss_fn,
            prepare_fn=prepare_loss_input, vocab_parallel_rank=0,
            vocab_parallel_group=dist.group.WORLD, context_parallel_group=None)
        total = total + loss
        metrics.append(mb_metrics)
    total.backward()
    return float(total), metrics, logits.grad


def _packing(batch):
    """Packed logits [1, T, V] and cu_seqlens (unpadded, padded) of the batch's sequences."""
    lengths = batch["input_lengths"]
    padded = (lengths + PACK_ALIGN - 1) // PACK_ALIGN * PACK_ALIGN
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    cu_padded = torch.nn.functional.pad(padded.cumsum(0), (1, 0)).to(torch.int32)
    gen = torch.Generator().manual_seed(99)
    packed = 1.5 * torch.randn(1, int(cu_padded[-1]), VOCAB, generator=gen)  # padding rows random
    for row, (start, length) in enumerate(zip(cu_padded[:-1].tolist(), lengths.tolist(), strict=True)):
        packed[0, start:start + length] = batch["logits"][row, :length]
    return packed, cu, cu_padded


def _packed(loss_fn, batch, fused: bool):
    from nemo_rl.algorithms.loss import (
        SequencePackingFusionLossWrapper,
        SequencePackingLossWrapper,
        prepare_loss_input,
        prepare_packed_loss_input,
    )

    packed, cu, cu_padded = _packing(batch)
    packed.requires_grad_(True)
    wrapper = SequencePackingFusionLossWrapper if fused else SequencePackingLossWrapper
    wrapped = wrapper(loss_fn=loss_fn,
                      prepare_fn=prepare_packed_loss_input if fused else prepare_loss_input,
                      cu_seqlens_q=cu, cu_seqlens_q_padded=cu_padded, vocab_parallel_rank=0,
                      vocab_parallel_group=dist.group.WORLD, context_parallel_group=None)
    seqs, toks = _global_counts(batch)
    loss, metrics = wrapped(packed, _data(batch), seqs, toks)
    loss.backward()
    return float(loss), [metrics], packed, packed.grad, cu, cu_padded


def _host_loss(fields):
    from nemo_rl.algorithms.loss import ClippedPGLossConfig, ClippedPGLossFn

    return ClippedPGLossFn(ClippedPGLossConfig(**{"reference_policy_kl_penalty": 0.0, **fields}))


def _grpo_train_keys(host_src: Path) -> list[str]:
    """Keys grpo_train puts in train_data, read from the host's source.

    The dict literal it builds plus each later ``train_data["key"] = ...`` (grpo.py is parsed,
    not imported: it needs Ray).
    """
    tree = ast.parse((host_src / "nemo_rl" / "algorithms" / "grpo.py").read_text())
    train = next(node for node in tree.body
                 if isinstance(node, ast.FunctionDef) and node.name == "grpo_train")
    keys = set()
    for node in ast.walk(train):
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "train_data" for t in node.targets):
            literal = next((a for a in getattr(node.value, "args", []) if isinstance(a, ast.Dict)),
                           None)
            keys |= {k.value for k in (literal.keys if literal else []) if isinstance(k, ast.Constant)}
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name)
                        and target.value.id == "train_data"
                        and isinstance(target.slice, ast.Constant)):
                    keys.add(target.slice.value)
    return sorted(keys)


class _ToyTokenizer:
    def __len__(self):
        return VOCAB

    def decode(self, ids):
        return "t\n" if ids[0] == NEWLINE_ID else f"t{ids[0]}"


def _sspo_through_host(batch, keys):
    """Our SSPO adapter driven by the host's own wrappers on a batch with exactly ``keys``.

    Built from the shipped recipe's ``nemo_sspo`` section.
    """
    from omegaconf import OmegaConf

    from nemo_sspo.integrations.nemo_rl import NeMoRLPolicyLoss

    recipe = OmegaConf.load(Path(__file__).parents[1] / "examples" / "integrations" / "nemo_rl"
                            / "sspo_grpo.yaml")
    section = OmegaConf.to_container(recipe.nemo_sspo)
    loss_fn = NeMoRLPolicyLoss.from_config(section, tokenizer=_ToyTokenizer())
    only_keys = {k: v for k, v in batch.items() if k in keys}
    only_keys["logits"] = batch["logits"]
    assert set(only_keys) - {"logits"} == set(keys), sorted(set(keys) - set(only_keys))
    loss, metrics, grad = _unpacked(loss_fn, only_keys, [slice(0, 2), slice(2, ROWS)])
    packed = _packed(loss_fn, only_keys, fused=False)
    return {"section": section, "input_type": loss_fn.input_type.value,
            "loss_type": loss_fn.loss_type.value,
            "loss": loss, "metrics": metrics, "grad": _figures(grad),
            "packed_loss": packed[0], "packed_grad": _figures(packed[3])}


def _figures(tensor: torch.Tensor):
    """Nested lists of 9-significant-digit floats (exact for float32) or ints."""
    if not tensor.is_floating_point():
        return tensor.tolist()
    flat = [float(f"{x:.9g}") for x in tensor.detach().double().flatten().tolist()]
    return torch.tensor(flat, dtype=torch.float64).reshape(tensor.shape).tolist()


def _floats(values):
    return {k: (float(v) if isinstance(v, (int, float, torch.Tensor)) else v)
            for k, v in values.items()}


def main() -> None:
    """Run every case through the host and write the record."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host-src", type=Path, required=True, help="NeMo-RL source checkout")
    parser.add_argument("--host-commit", required=True, help="the checkout's commit, recorded")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    from nemo_rl.algorithms.loss import interfaces

    batch = _batch(seed=0)
    cases = {}
    for name, (host_fields, ours, our_fields) in CASES.items():
        loss, metrics, grad = _unpacked(_host_loss(host_fields), batch, [slice(None)])
        cases[name] = {"host_config": host_fields, "loss_name": ours, "config": our_fields,
                       "loss": loss, "metrics": [_floats(m) for m in metrics],
                       "grad": _figures(grad)}
    host_fields, ours, our_fields = CASES["grpo_sequence"]
    loss, metrics, grad = _unpacked(_host_loss(host_fields), batch, [slice(0, 2), slice(2, ROWS)])
    cases["two_micro_batches"] = {"host_config": host_fields, "loss_name": ours,
                                  "config": our_fields, "micro_batches": [[0, 2], [2, ROWS]],
                                  "loss": loss, "metrics": [_floats(m) for m in metrics],
                                  "grad": _figures(grad)}
    packing = None
    for fused in (False, True):
        host_fields, ours, our_fields = CASES["grpo_token"]
        loss, metrics, packed, grad, cu, cu_padded = _packed(_host_loss(host_fields), batch, fused)
        packing = {"logits": _figures(packed), "cu_seqlens_q": cu.tolist(),
                   "cu_seqlens_q_padded": cu_padded.tolist()}
        cases["packed_fused" if fused else "packed"] = {
            "host_config": host_fields, "loss_name": ours, "config": our_fields, "loss": loss,
            "metrics": [_floats(m) for m in metrics], "grad": _figures(grad)}
    keys = _grpo_train_keys(args.host_src)
    record = {
        "host": "NVIDIA-NeMo/RL", "host_commit": args.host_commit,
        "recorded_on": datetime.date.today().isoformat(), "torch": torch.__version__,
        "dtype": "float32", "recorder": "tools/record_nemo_rl.py",
        "enums": {enum: {m.name: m.value for m in getattr(interfaces, enum)}
                  for enum in ("LossType", "LossInputType", "MetricNormalizer")},
        "grpo_train_batch_keys": keys,
        "batch": {k: _figures(v) for k, v in batch.items()},
        "packing": packing,
        "sspo_newline_id": NEWLINE_ID,
        "cases": cases,
        "sspo_through_host": _sspo_through_host(batch, keys),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, separators=(",", ":")) + "\n")
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes), cases: {sorted(cases)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
