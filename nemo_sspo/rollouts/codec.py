"""Rollouts as tensors over the bridge group between rollout ranks and training ranks.

The wire layout is in :mod:`nemo_sspo.rollouts.worker`'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from nemo_sspo.rollout import RolloutBatch
from nemo_sspo.rollouts.records import Rollout, RolloutPosition, VersionedRollout

__all__ = ['recv_free_rollout', 'recv_rollout', 'send_rollout', 'send_start']

_START_TAG = 0  # step tags start at 1

_END_TAG = 2**31 - 1  # free-running: the number of rollouts sent, after the stop notice

_ROLLOUT_TAG = 2**31 - 2  # free-running: every rollout's header (received from any rollout rank)

_HEADER = 13

_TAG_FIELD = 11  # the header's field holding the parts' tag (a free-running rollout's number)

@dataclass
class _Sent:
    """Tensors of an asynchronous send, kept alive until its works complete."""

    tensors: list[torch.Tensor]
    works: list

def send_rollout(versioned: VersionedRollout, *, dst: int, group: dist.ProcessGroup, tag: int,
                 header_tag: int | None = None) -> _Sent:
    """Starts sending a versioned rollout to world rank ``dst`` over ``group`` (module docstring).

    Args:
        versioned: the rollout, its policy version and data position (one version for all its rows).
        dst: the receiving rank (rank numbering of ``group``).
        group: the bridge group.
        tag: message tag of the parts, the same on both sides (lock-step: the step; free-running:
            the rollout's number).
        header_tag: the header's tag, when it differs from ``tag`` (free-running: :data:`_ROLLOUT_TAG`).

    Returns:
        The pending send; call ``wait`` on each of its works (or keep it) before dropping it.
    """
    r, rb = versioned.rollout, versioned.rollout.batch
    text = [t.encode() for t in rb.response_texts]
    header = torch.tensor([rb.prompt_ids.shape[0], rb.prompt_ids.shape[1], rb.response_ids.shape[1], r.rounds,
                           r.generated_groups, versioned.version, versioned.problems_drawn, sum(map(len, text)),
                           *(round(t * 1e6) for t in versioned.generated), len(r.prompt_keys), tag,
                           int(rb.token_versions is not None)],
                          dtype=torch.int64)
    # The groups' prompt keys (32 hex digits each, sampling.prompt_key) as 16 bytes per group.
    keys = torch.tensor([list(bytes.fromhex(key)) for key in r.prompt_keys], dtype=torch.uint8).reshape(-1, 16)
    body = [rb.prompt_ids, rb.prompt_mask.to(torch.uint8), rb.response_ids, rb.response_mask.to(torch.uint8),
            rb.truncated.to(torch.uint8), rb.rollout_logprobs.float(), r.task_rewards.float(), r.rewards.float(),
            torch.tensor([len(t) for t in text], dtype=torch.int64),
            torch.frombuffer(bytearray(b"".join(text) or b"\0"), dtype=torch.uint8), keys,
            *([] if rb.token_versions is None else [rb.token_versions])]
    parts = [t.contiguous() for t in body]
    works = [group.send([header], dst, tag if header_tag is None else header_tag)]
    return _Sent([header, *parts], works + [group.send([t], dst, tag) for t in parts])

def recv_rollout(*, src: int, group: dist.ProcessGroup, tag: int, what: str | None = None) -> VersionedRollout:
    """Receives what :func:`send_rollout` sent from world rank ``src`` with ``tag`` (header included).

    Args:
        src: the sending rollout rank (world rank).
        group: the bridge group.
        tag: the message tag (the step).
        what: the awaited rollout, for the error (default ``"rollout for step <tag>"``).

    Raises:
        RuntimeError: naming ``src`` and ``what``, when it died or sent nothing within the group's timeout.
    """
    what = what or f"rollout for step {tag}"
    try:
        header = _recv(torch.zeros(_HEADER, dtype=torch.int64), src, group, tag)
    except RuntimeError as err:
        raise _silent(src, what, err) from err
    return _recv_parts(header, src, group, what)

def recv_free_rollout(*, group: dist.ProcessGroup, sources: list[int], src: int | None = None,
                      what: str) -> tuple[int, int, VersionedRollout]:
    """Receives the next free-running rollout (header tag :data:`_ROLLOUT_TAG`) from world rank ``src``,
    or with ``src`` None from whichever of ``sources`` sends first.

    Args:
        group: the bridge group.
        sources: world ranks of the rollout ranks (named in the error).
        src: the sender, or None for any.
        what: the awaited rollout, for the error.

    Returns:
        ``(src, number, rollout)``: its sender's world rank, its number and the rollout.

    Raises:
        RuntimeError: naming the rank(s) and ``what``, when none sent within the group's timeout.
    """
    header = torch.zeros(_HEADER, dtype=torch.int64)
    try:
        if src is None:
            work = group.recv_anysource([header], _ROLLOUT_TAG)
            work.wait()
            src = work.source_rank()
        else:
            _recv(header, src, group, _ROLLOUT_TAG)
    except RuntimeError as err:
        raise _silent(sources if src is None else src, what, err) from err
    return src, int(header[_TAG_FIELD]), _recv_parts(header, src, group, what)

def _silent(src: int | list[int], what: str, err: RuntimeError) -> RuntimeError:
    if isinstance(src, int):
        return RuntimeError(f"rollout rank {src} sent no {what} (it died or hung past the timeout): {err}")
    return RuntimeError(f"no rollout rank of {src} sent {what} (they died or hung past the timeout): {err}")

def _recv_parts(header: torch.Tensor, src: int, group: dist.ProcessGroup, what: str) -> VersionedRollout:
    """The parts that follow a received ``header`` from ``src`` (on the tag it names)."""
    rows, prompt_w, response_w, rounds, generated, version, drawn, text_bytes, start, end, groups, tag, partial = \
        header.tolist()
    shapes = [((rows, prompt_w), torch.int64), ((rows, prompt_w), torch.uint8), ((rows, response_w), torch.int64),
              ((rows, response_w), torch.uint8), ((rows,), torch.uint8), ((rows, response_w), torch.float32),
              ((rows,), torch.float32), ((rows,), torch.float32), ((rows,), torch.int64),
              ((max(text_bytes, 1),), torch.uint8), ((groups, 16), torch.uint8),
              *([((rows, response_w), torch.int64)] if partial else [])]
    try:
        parts = [_recv(torch.zeros(shape, dtype=dtype), src, group, tag) for shape, dtype in shapes]
    except RuntimeError as err:
        raise _silent(src, what, err) from err
    prompt_ids, prompt_mask, response_ids, response_mask, truncated, logprobs, task, shaped, lengths, raw, keys = \
        parts[:11]
    blob, texts, offset = bytes(raw[:text_bytes].tolist()), [], 0
    for length in lengths.tolist():
        texts.append(blob[offset:offset + length].decode())
        offset += length
    batch = RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask.bool(), response_ids=response_ids,
                         response_mask=response_mask.bool(), truncated=truncated.bool(), response_texts=texts,
                         rollout_logprobs=logprobs, token_versions=parts[11] if partial else None)
    rollout = Rollout(batch=batch, task_rewards=task, rewards=shaped, rounds=rounds, generated_groups=generated,
                      prompt_keys=[bytes(row).hex() for row in keys.tolist()])
    return VersionedRollout(rollout, version=version, problems_drawn=drawn, generated=(start / 1e6, end / 1e6))

def send_start(completed_steps: int, position: RolloutPosition, replicas: list[int], *, dst: int,
               group: dist.ProcessGroup) -> None:
    """Training rank 0 tells rollout rank ``dst`` where the run starts (once to each rollout rank).

    The message holds the steps already done, ``dst``'s position (all 0 for a fresh run; a resumed
    run's weights follow, as a refit) and the world rank that receives each data-parallel replica's
    rollouts (its first model-parallel rank), in data-parallel order.

    Raises:
        RuntimeError: naming ``dst``, when it died or did not listen within the group's timeout.
    """
    message = torch.tensor([completed_steps, *position, len(replicas), *replicas], dtype=torch.int64)
    try:
        group.send([message[:4].clone()], dst, _START_TAG).wait()
        group.send([message[4:].clone()], dst, _START_TAG).wait()
    except RuntimeError as err:
        raise RuntimeError(f"rollout rank {dst} did not take the start of the run (it died or hung past the "
                           f"timeout): {err}") from err

def _recv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup, tag: int) -> torch.Tensor:
    group.recv([tensor], src, tag).wait()
    return tensor
