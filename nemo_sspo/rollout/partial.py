"""Partial rollouts: responses stopped at a refit and continued with the new weights.

A long response started before an update would otherwise finish on old weights. With
``rollout.schedule.partial`` (free-running rollout ranks, ``nemo_sspo.rollouts.worker``) the engine stops
sampling as soon as new weights are waiting (``interrupt``, polled between decode steps), the
rollout rank loads them (``refit``), and the unfinished responses continue from the tokens they
have, prompt and prefix fed again (slime's and AReaL's partial rollouts do the same). Each token
keeps the engine log-prob it was sampled with and the version of the weights that sampled it
(:attr:`nemo_sspo.rollout.RolloutBatch.token_versions`), so the off-policy corrections compare
each token with the policy that really sampled it, and the staleness bound applies to a response's
oldest token.

Seeds: the first stretch uses the call's seed, so a generation nobody interrupts is exactly the
engine's ``generate``; the k-th continuation uses :func:`continuation_seed` ``(seed, k)`` (ours).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from nemo_sspo.algorithms.batch import pad_cat
from nemo_sspo.rollout.hf_engine import RolloutBatch

__all__ = ["RolloutStopped", "continuation_seed", "generate_with_refits"]


class RolloutStopped(Exception):
    """The run ended (the trainer's stop) while responses were unfinished; they are abandoned."""


def continuation_seed(seed: int, segment: int) -> int:
    """The seed of a generation's ``segment``-th continuation (``seed`` itself for segment 0): a
    63-bit hash of both numbers (ours).
    """
    if segment == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/continue/{segment}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def generate_with_refits(engine, prompts: list[str], *, seed: int, version: int, max_new_tokens: int,
                         interrupt: Callable[[], bool], refit: Callable[[], int | None],
                         pad_id: int, decode: Callable[[torch.Tensor], list[str]]) -> RolloutBatch:
    """One response per prompt, continued across refits (module docstring).

    Args:
        engine: an engine with ``generate_partial(prompts, prefixes, *, seed, interrupt)``
            (:meth:`nemo_sspo.rollout.HFRolloutEngine.generate_partial`).
        prompts: rendered prompts.
        seed: the generation's seed.
        version: the version of the weights the engine holds now.
        max_new_tokens: the response length cap (the engine's).
        interrupt: whether new weights wait (polled by the engine between decode steps).
        refit: loads the waiting weights; returns their version, or None when the run stops instead.
        pad_id: the tokenizer's pad id.
        decode: ``[B, T]`` ids (pad off the mask) -> response texts.

    Returns:
        The whole responses as one :class:`RolloutBatch`, with ``token_versions``.

    Raises:
        RolloutStopped: ``refit`` returned None while responses were unfinished.
    """
    rows = range(len(prompts))
    tokens = [torch.zeros(0, dtype=torch.int64) for _ in rows]
    logprobs = [torch.zeros(0, dtype=torch.float32) for _ in rows]
    versions = [torch.zeros(0, dtype=torch.int64) for _ in rows]
    finished = [False for _ in rows]
    active, segment, first = list(rows), 0, None
    while active:
        part = engine.generate_partial([prompts[b] for b in active], [tokens[b] for b in active],
                                       seed=continuation_seed(seed, segment), interrupt=interrupt)
        first = part if first is None else first
        for i, b in enumerate(active):
            n = int(part.response_mask[i].sum())
            tokens[b] = torch.cat([tokens[b], part.response_ids[i, :n]])
            logprobs[b] = torch.cat([logprobs[b], part.rollout_logprobs[i, :n]])
            versions[b] = torch.cat([versions[b], torch.full((n,), version, dtype=torch.int64)])
            finished[b] = not bool(part.truncated[i])
        active = [b for b in active if not finished[b] and len(tokens[b]) < max_new_tokens]
        if active:  # stopped for new weights
            version = refit()
            if version is None:
                raise RolloutStopped(f"{len(active)} unfinished response(s) abandoned at the stop")
            segment += 1
    mask = pad_cat([torch.ones(1, len(t), dtype=torch.bool) for t in tokens], False)
    response_ids = pad_cat([t[None] for t in tokens], pad_id)
    return RolloutBatch(prompt_ids=first.prompt_ids, prompt_mask=first.prompt_mask, response_ids=response_ids,
                        response_mask=mask, truncated=torch.tensor([not f for f in finished]),
                        response_texts=decode(response_ids), rollout_logprobs=pad_cat([p[None] for p in logprobs], 0.0),
                        token_versions=pad_cat([v[None] for v in versions], -1))
