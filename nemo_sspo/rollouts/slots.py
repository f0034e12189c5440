"""Rows, slots and stacking: how a step's prompt groups split over generating ranks and join again.

Slot arithmetic (which rollout rank generates which replica's slots: :func:`slot_routes`), cutting a
rollout to some slots' rows (:func:`slot_rows`) and stacking parts in order (:func:`concat_rollouts`,
:func:`stack_rollouts`, :func:`merge_rollouts`). The design is in :mod:`nemo_sspo.rollouts.worker`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from nemo_sspo.algorithms.batch import pad_cat
from nemo_sspo.parallel.world_split import WorldSplit
from nemo_sspo.rollout import RolloutBatch
from nemo_sspo.rollout.hf_engine import PAD_ID
from nemo_sspo.rollouts.records import Rollout, VersionedRollout

__all__ = ["SlotRoute", "concat_rollouts", "merge_rollouts", "rollout_replica", "slot_routes", "slot_rows", "stack_rollouts"]


def concat_rollouts(parts: list[RolloutBatch], *, pad_id: int) -> RolloutBatch:
    """Stacks rollout batches (e.g. one per prompt group) along rows, field by field as each field's
    metadata says (:class:`~nemo_sspo.rollout.hf_engine.RolloutBatch`): prompt columns left-padded to
    the widest part, response and packed columns right-padded, with the field's fill (``pad_id`` for
    token ids; masks False, log-probs 0.0, token versions -1, routes expert 0); row fields
    (truncation flags, texts) concatenated in order.

    Raises:
        ValueError: some parts carry an optional field (routes, token versions) and others do not.
    """
    stacked = {}
    for f in fields(RolloutBatch):
        values = [getattr(p, f.name) for p in parts]
        present = [value is not None for value in values]
        if any(present) and not all(present):
            raise ValueError(f"concat_rollouts: some rollout batches carry {f.name} and others do not")
        frame, fill = f.metadata["frame"], f.metadata.get("fill")
        if not all(present):
            stacked[f.name] = None
        elif frame == "row":
            stacked[f.name] = torch.cat(values) if isinstance(values[0], torch.Tensor) else sum(values, [])
        else:
            stacked[f.name] = pad_cat(values, pad_id if fill == PAD_ID else fill, left=frame == "prompt")
    return RolloutBatch(**stacked)


def slot_rows(rollout: Rollout, start: int, stop: int) -> Rollout:
    """Rows ``start:stop`` of a rollout, prompts and responses trimmed to those rows' own padding.

    Args:
        rollout: a step's rollout.
        start: first row.
        stop: row after the last.

    Returns:
        A :class:`Rollout` of the rows, with the step's ``rounds``; its ``generated_groups`` counts
        the groups generated for those rows' slots where ``rollout.slot_generated`` records them
        (rows ``start:stop`` must then cover whole groups), else it is the step's. The step's
        reward-timeout and scored-response counts are not split over rows: the cut has None and 0.

    Raises:
        ValueError: the rollout carries engine routes (router replay R3), which the bridge does not send.
    """
    if rollout.batch.routes is not None:
        raise ValueError("slot_rows got a rollout with engine routes; separate placement does not send them "
                         "(router replay r3 needs colocated placement)")
    rb = rollout.batch
    widths = {"prompt": int(rb.prompt_mask[start:stop].sum(dim=1).max()),
              "response": int(rb.response_mask[start:stop].sum(dim=1).max())}
    cut = slice(start, stop)
    per_group = rb.prompt_ids.shape[0] // len(rollout.prompt_keys)  # responses per prompt group
    groups = slice(start // per_group, stop // per_group)
    generated, per_slot = rollout.generated_groups, rollout.slot_generated
    if per_slot is not None:
        generated, per_slot = sum(per_slot[groups]), per_slot[groups]
    rows = {}
    for f in fields(RolloutBatch):
        value, frame = getattr(rb, f.name), f.metadata["frame"]
        if value is None or frame == "row":
            rows[f.name] = None if value is None else value[cut]
        elif frame == "prompt":
            rows[f.name] = value[cut, value.shape[1] - widths["prompt"]:]
        else:  # response (a packed field, the routes, is refused above)
            rows[f.name] = value[cut, :widths["response"]]
    return Rollout(batch=RolloutBatch(**rows), task_rewards=rollout.task_rewards[cut], rewards=rollout.rewards[cut],
                   rounds=rollout.rounds, generated_groups=generated, prompt_keys=rollout.prompt_keys[groups],
                   slot_generated=per_slot)


@dataclass(frozen=True)
class SlotRoute:
    """Slots ``first:stop`` of every step go from rollout rank ``source`` to replica ``replica``.

    Attributes:
        source: index j in 0..R-1 of the generating rollout rank (world rank T + j).
        replica: data-parallel rank d in 0..D-1 of the training replica that trains on them.
        first: first global slot (prompt group) of the route.
        stop: the slot after its last.
    """

    source: int
    replica: int
    first: int
    stop: int


def slot_routes(prompts_per_step: int, dp_size: int, num_rollout_ranks: int) -> list[SlotRoute]:
    """Which slots each rollout rank sends to which training replica (module docstring).

    Rollout rank j generates slots ``[j P/R, (j+1) P/R)``, replica d trains on ``[d P/D, (d+1) P/D)``;
    one route per overlapping pair, holding the overlap. Ours (the colocated slot split of
    :mod:`nemo_sspo.rollouts.sampling` applied to each side).

    Args:
        prompts_per_step: P, prompt groups of a step.
        dp_size: D, training replicas; divides P.
        num_rollout_ranks: R, rollout ranks; divides P.

    Returns:
        The routes ordered by source, then replica; each replica's routes are in slot order and
        cover its slots exactly once.

    Raises:
        ValueError: D or R is below 1 or does not divide P.
    """
    for name, size in (("dp_size", dp_size), ("num_rollout_ranks", num_rollout_ranks)):
        if size < 1 or prompts_per_step % size:
            raise ValueError(f"{name}={size} must be >= 1 and divide prompts_per_step={prompts_per_step}")
    per_source, per_replica = prompts_per_step // num_rollout_ranks, prompts_per_step // dp_size
    routes = []
    for source in range(num_rollout_ranks):
        low, high = source * per_source, (source + 1) * per_source
        for replica in range(low // per_replica, -(-high // per_replica)):
            routes.append(SlotRoute(source, replica, max(low, replica * per_replica),
                                    min(high, (replica + 1) * per_replica)))
    return routes


def merge_rollouts(parts: list[VersionedRollout], *, pad_id: int) -> VersionedRollout:
    """A replica's rollout from the parts its rollout ranks sent, in slot order.

    Rows are stacked with :func:`nemo_sspo.rollouts.slots.concat_rollouts` (re-padded to the widest
    part, as a colocated generator pads its slots), rewards and prompt keys concatenated, generated
    groups summed. The policy version is the oldest part's (what staleness must bound), the
    generation window spans every part's.

    Args:
        parts: the received parts, at least one.
        pad_id: the tokenizer's pad id.

    Returns:
        The merged :class:`VersionedRollout`.

    Raises:
        ValueError: ``parts`` is empty, or its parts ran different sampling rounds or data positions
            (rollout ranks out of step).
    """
    if not parts:
        raise ValueError("merge_rollouts needs at least one part")
    rounds = {p.rollout.rounds for p in parts}
    drawn = {p.problems_drawn for p in parts}
    if len(rounds) > 1 or len(drawn) > 1:
        raise ValueError(f"rollout ranks out of step: sampling rounds {sorted(rounds)}, data positions "
                         f"{sorted(drawn)} (each must be one number)")
    return stack_rollouts(parts, pad_id=pad_id, problems_drawn=drawn.pop())


def stack_rollouts(parts: list[VersionedRollout], *, pad_id: int, problems_drawn: int) -> VersionedRollout:
    """Rollouts stacked in order into one (:func:`merge_rollouts` without its checks).

    Rows are stacked with :func:`nemo_sspo.rollouts.slots.concat_rollouts` (re-padded to the widest),
    rewards and prompt keys concatenated, generated groups summed, sampling rounds the most of any.
    Each response keeps its part's version (:attr:`VersionedRollout.sample_versions`); the rollout's
    version is the oldest, its generation window spans every part's.

    Args:
        parts: rollouts, at least one.
        pad_id: the tokenizer's pad id.
        problems_drawn: the data position the stack records.

    Returns:
        The stacked :class:`VersionedRollout`.
    """
    rollouts = [p.rollout for p in parts]
    rollout = Rollout(batch=concat_rollouts([r.batch for r in rollouts], pad_id=pad_id),
                      task_rewards=torch.cat([r.task_rewards for r in rollouts]),
                      rewards=torch.cat([r.rewards for r in rollouts]), rounds=max(r.rounds for r in rollouts),
                      generated_groups=sum(r.generated_groups for r in rollouts),
                      prompt_keys=[key for r in rollouts for key in r.prompt_keys])
    versions = torch.cat([p.versions() for p in parts])
    uniform = bool((versions == versions[0]).all())
    return VersionedRollout(rollout, version=int(versions.min()), problems_drawn=problems_drawn,
                            generated=(min(p.generated[0] for p in parts), max(p.generated[1] for p in parts)),
                            sample_versions=None if uniform else versions)


@dataclass(frozen=True)
class _RolloutReplica:
    """A sampler's data-parallel view of a rollout rank: rank ``dp_rank`` of the ``dp_size`` rollout
    ranks, whose collectives run over the rollout side's default group (``dp_group`` None).
    """

    dp_size: int
    dp_rank: int
    dp_group: None = None


def rollout_replica(split: WorldSplit) -> _RolloutReplica:
    """The ``groups`` to build a rollout rank's :class:`nemo_sspo.rollouts.sampling.RolloutSampler` with:
    rollout rank j of R generates slots as data-parallel rank j of R (module docstring).

    Raises:
        ValueError: ``split`` is a training rank's.
    """
    return _RolloutReplica(dp_size=split.num_rollout_ranks, dp_rank=split.rollout_index(split.rank))
