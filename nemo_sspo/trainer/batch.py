"""Stacking the rollout batches of several prompt groups (the target-frame packing is
:mod:`nemo_sspo.algorithms.batch`).
"""

from __future__ import annotations

import torch

from nemo_sspo.algorithms.batch import pad_cat
from nemo_sspo.rollout import RolloutBatch

__all__ = ["concat_rollouts"]


def concat_rollouts(parts: list[RolloutBatch], *, pad_id: int) -> RolloutBatch:
    """Stacks rollout batches (e.g. one per prompt group) along rows.

    Prompts ``[B_k, P_k]`` are left-padded to ``max P_k`` with ``pad_id`` (mask False), responses
    ``[B_k, T_k]`` and their float32 rollout log-probs right-padded to ``max T_k`` (pad_id / False /
    0.0), engine routes ``[B_k, S_k, L, k]`` (packed rows) right-padded with expert 0, token versions
    right-padded with -1; truncation flags and texts are concatenated in order.

    Raises:
        ValueError: some parts carry routes (or token versions) and others do not.
    """
    with_routes = [p.routes is not None for p in parts]
    with_versions = [p.token_versions is not None for p in parts]
    for name, present in (("engine routes", with_routes), ("token versions", with_versions)):
        if any(present) and not all(present):
            raise ValueError(f"concat_rollouts: some rollout batches carry {name} and others do not")
    return RolloutBatch(
        prompt_ids=pad_cat([p.prompt_ids for p in parts], pad_id, left=True),
        prompt_mask=pad_cat([p.prompt_mask for p in parts], False, left=True),
        response_ids=pad_cat([p.response_ids for p in parts], pad_id, left=False),
        response_mask=pad_cat([p.response_mask for p in parts], False, left=False),
        truncated=torch.cat([p.truncated for p in parts]),
        response_texts=[text for p in parts for text in p.response_texts],
        rollout_logprobs=pad_cat([p.rollout_logprobs for p in parts], 0.0, left=False),
        routes=pad_cat([p.routes for p in parts], 0) if all(with_routes) else None,
        token_versions=pad_cat([p.token_versions for p in parts], -1) if all(with_versions) else None,
    )
