"""Qwen3-MoE expert weights: checkpoint names (one tensor per expert) <-> transformers' fused layout.

Checkpoints on disk, ``save_pretrained`` output and vLLM's ``load_weights`` name every expert's
projections separately: ``model.layers.{l}.mlp.experts.{e}.gate_proj.weight`` [F, H],
``up_proj.weight`` [F, H], ``down_proj.weight`` [H, F] (F = ``moe_intermediate_size``). That is the
convention of this package's state dicts. transformers 5's ``Qwen3MoeExperts`` holds them fused in
memory: ``mlp.experts.gate_up_proj`` [E, 2F, H] (rows ``[gate_e; up_e]``: its forward chunks the
projection's output in two, gate first) and ``mlp.experts.down_proj`` [E, H, F]. transformers converts
on ``from_pretrained`` / ``save_pretrained``; these two functions do the same for state dicts held in
memory (building a transformers model from ours, drawing random weights from one).
"""

from __future__ import annotations

import re

import torch

__all__ = ["fuse_expert_weights", "split_expert_weights"]

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def fuse_expert_weights(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint names -> transformers' fused in-memory parameters.

    Args:
        state_dict: HF names -> tensors; entries that are not per-expert projections pass unchanged.

    Returns:
        A new dict: each layer's experts as ``{prefix}.gate_up_proj`` [E, 2F, H] and
        ``{prefix}.down_proj`` [E, H, F], at the position of the layer's first expert entry.

    Raises:
        ValueError: a layer whose expert ids are not 0..E-1 or that lacks one of an expert's three
            projections, naming the layer.
    """
    groups: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    out: dict[str, torch.Tensor | None] = {}
    for name, tensor in state_dict.items():
        match = _PER_EXPERT.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
        if prefix not in groups:
            groups[prefix] = {}
            out[f"{prefix}.gate_up_proj"] = out[f"{prefix}.down_proj"] = None  # keep the position
        groups[prefix][(expert, proj)] = tensor
    for prefix, parts in groups.items():
        count = 1 + max(expert for expert, _ in parts)
        wanted = {(e, p) for e in range(count) for p in ("gate_proj", "up_proj", "down_proj")}
        if set(parts) != wanted:
            missing = sorted(wanted - set(parts))
            raise ValueError(f"state_dict: {prefix} is missing expert projections {missing[:4]}")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]], dim=0) for e in range(count)])
        out[f"{prefix}.down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(count)])
    return out


def split_expert_weights(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`fuse_expert_weights`: fused experts -> per-expert checkpoint names.

    ``gate_up_proj`` / ``down_proj`` become the experts in order (gate, up, down of expert 0, then
    expert 1, ...), in place of ``gate_up_proj``. Other entries pass unchanged; the per-expert
    tensors are views.

    Args:
        state_dict: HF names -> tensors, as transformers' ``state_dict()`` of a Qwen3-MoE model.

    Returns:
        A new dict with per-expert names.

    Raises:
        ValueError: a ``gate_up_proj`` without its ``down_proj`` (or with an odd row count).
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        match = _FUSED.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, kind = match.group(1), match.group(2)
        if kind == "down_proj":
            continue  # written with its gate_up_proj
        down = state_dict.get(f"{prefix}.down_proj")
        if down is None or tensor.shape[1] % 2:
            raise ValueError(f"state_dict: {name} {tuple(tensor.shape)} needs {prefix}.down_proj and an "
                             "even number of rows [gate; up]")
        for expert in range(tensor.shape[0]):
            gate, up = tensor[expert].chunk(2, dim=0)
            out[f"{prefix}.{expert}.gate_proj.weight"] = gate
            out[f"{prefix}.{expert}.up_proj.weight"] = up
            out[f"{prefix}.{expert}.down_proj.weight"] = down[expert]
    return out
