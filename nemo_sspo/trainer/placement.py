"""``rollout.placement: separate``: rollout ranks generate and score while the training ranks train.

One launched world (:func:`nemo_sspo.parallel.placement.split_world`): training ranks 0 .. T-1 run
the policy (TP x PP x DP as colocated), the last R ranks (``rollout.num_ranks``) are rollout ranks.
Each holds one engine replica, the reward pool and the prompt stream, and runs lock-step
(``rollout.max_staleness = k``, :mod:`nemo_sspo.trainer.staleness`): it generates the rollouts of
steps 1 .. k + 1 with the initial weights, then after each step t's update receives the weights
(bucket by bucket, :mod:`nemo_sspo.parallel.weight_broadcast`; one broadcast reaches every rollout
rank) and generates step t + k + 1 while the trainer works on step t + 1.

Slots (:mod:`nemo_sspo.trainer.sampling`): rollout rank j generates the step's prompt groups as
data-parallel rank j of R would (slots ``[j P/R, (j+1) P/R)``, the same prompts and seeds as colocated
generators; dynamic sampling's refill rounds all-reduce over the rollout ranks' own default group),
and training replica d trains on slots ``[d P/D, (d+1) P/D)``. :func:`slot_routes` pairs them: every
rollout rank sends each replica whose slots overlap its own the overlap's rows, trimmed to their own
padding, to the replica's first model-parallel rank, which stacks the parts it receives in slot
order (:func:`merge_rollouts`) into what a colocated generator of its slots builds. So any D and R
fit as long as R divides P (``rollout.prompts_per_step``).

A run starts with training rank 0 telling every rollout rank the steps already done and the data
position (:func:`send_start`). A resumed run then sends the resumed weights as a refit: the rollout
ranks replay the data position and generate the next steps from those weights (lag 0 at the first
resumed step, whatever k), and log that they did.

Rollouts travel as plain tensors over the bridge group (:func:`send_rollout` / :func:`recv_rollout`):
a header ``int64 [13]`` (rows, prompt width, response width, rounds, groups generated, policy
version, data position, text bytes, generation start and end in unix microseconds, prompt groups,
the tag of the parts that follow, and 1 when token versions follow), then prompt ids / mask,
response ids / mask, truncation flags, engine log-probs, task and shaped rewards, response text
lengths and bytes, each group's prompt key as ``uint8 [groups, 16]`` (DCPO's per-prompt history is
keyed by it) and, for a partial rollout, each token's version ``int64 [rows, response width]``. Sends are asynchronous,
so a rollout rank never waits for a trainer that is busy with an earlier step.

``rollout.staleness_schedule: free`` (:class:`nemo_sspo.trainer.staleness.FreeQueue` decides when
to generate). Each of the R rollout ranks numbers its rollouts and generates them back to back with
the newest weights it has, each holding its P / R slots of "step" n for its number n, drawn from a
shard of the prompt stream of its own (:class:`nemo_sspo.data.ShardedSource`; no collective between
rollout ranks, so none waits for another). It sends every rollout to training rank 0, the header with
tag :data:`_ROLLOUT_TAG` and the parts with its number. Training rank 0 receives headers from any
rollout rank (gloo's any-source receive) and so takes R rollouts per step in the order they arrive
(:class:`RolloutCollector`), dropping those too stale; the training ranks get the step from it.
Between two rollouts a rollout rank looks, without blocking, for a version notice
(:mod:`nemo_sspo.parallel.version_notice`) and, when one has come, takes that version's weights
bucket by bucket; with ``rollout.partial`` it also looks between two decode steps and continues the
unfinished responses with the new weights (:mod:`nemo_sspo.rollout.partial`). The trainer posts the notice and its whole weight broadcast without waiting
(:func:`nemo_sspo.parallel.weight_broadcast.post_weight_broadcast`) and goes on to its next step.
What blocks what:

- training rank 0 blocks when fewer than R fresh rollouts have arrived for the step;
- training rank 0 never waits to post weights: after step t it posts version t to every rollout
  rank that has taken the version it posted to it before, each over its own pair group
  (:meth:`FreeRefit.free_ranks`), and the others skip version t and get a newer one after a later
  step, so a rank that finishes a long generation takes the newest weights there are. Until a post
  is taken rank 0 keeps one host copy of the export;
- a rollout rank blocks for the next notice when :meth:`FreeQueue.may_generate` says no (with
  ``wait``: k + 1 of its rollouts not yet taken, or as many as the remaining steps can train).

A rollout rank that dies or hangs is named: the any-source receive fails after the group's timeout
when no rank sends, and a rank that sends nothing for longer than ``rollout.peer_timeout_s`` while
others do is named at the next arrival (:meth:`RolloutCollector.next`).

After the last step the trainer posts a stop notice instead of weights; each rollout rank finishes
the rollout it is generating, sends training rank 0 the number of rollouts it sent (tag
:data:`_END_TAG`), and rank 0 receives and discards those it has not taken
(:meth:`RolloutCollector.drain`), so every send is matched and both sides exit.

What is reproducible: a rollout is a function of the seed, its rank, its number, the version it was
generated with and its rank's data position (which follows from that rank's earlier rollouts), and a
step trains the rollouts it took in arrival order. So a run repeats exactly given the same arrival
order and versions; which rollout arrives first and which version a rank holds depend on timing, so
two free-running runs generally differ (lock-step runs do not).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from nemo_sspo.parallel.placement import WorldSplit
from nemo_sspo.parallel.version_notice import STOP, Notice, NoticeListener, post_notice
from nemo_sspo.parallel.weight_broadcast import (
    PendingBroadcast,
    encode_weight_buckets,
    post_weight_broadcast,
    receive_weight_buckets,
)
from nemo_sspo.rollout import RolloutBatch
from nemo_sspo.rollout.partial import RolloutStopped
from nemo_sspo.trainer.batch import concat_rollouts
from nemo_sspo.trainer.sampling import RefitHooks, Rollout
from nemo_sspo.trainer.staleness import FreeQueue, VersionedRollout

__all__ = ["FreeRefit", "RolloutCollector", "RolloutPosition", "RolloutWorker", "SlotRoute", "merge_rollouts",
           "recv_free_rollout", "recv_rollout", "rollout_replica", "send_rollout", "send_start", "slot_routes",
           "slot_rows", "stack_rollouts"]

logger = logging.getLogger(__name__)

_START_TAG = 0  # step tags start at 1
_END_TAG = 2**31 - 1  # free-running: the number of rollouts sent, after the stop notice
_ROLLOUT_TAG = 2**31 - 2  # free-running: every rollout's header (received from any rollout rank)

_HEADER = 13
_TAG_FIELD = 11  # the header's field holding the parts' tag (a free-running rollout's number)


def slot_rows(rollout: Rollout, start: int, stop: int) -> Rollout:
    """Rows ``start:stop`` of a rollout, prompts and responses trimmed to those rows' own padding.

    Args:
        rollout: a step's rollout.
        start: first row.
        stop: row after the last.

    Returns:
        A :class:`Rollout` of the rows, with the step's ``rounds``; its ``generated_groups`` counts
        the groups generated for those rows' slots where ``rollout.slot_generated`` records them
        (rows ``start:stop`` must then cover whole groups), else it is the step's.

    Raises:
        ValueError: the rollout carries engine routes (router replay R3), which the bridge does not send.
    """
    if rollout.batch.routes is not None:
        raise ValueError("slot_rows got a rollout with engine routes; separate placement does not send them "
                         "(router replay r3 needs colocated placement)")
    rb = rollout.batch
    prompt_width = int(rb.prompt_mask[start:stop].sum(dim=1).max())
    response_width = int(rb.response_mask[start:stop].sum(dim=1).max())
    cut = slice(start, stop)
    per_group = rb.prompt_ids.shape[0] // len(rollout.prompt_keys)  # responses per prompt group
    groups = slice(start // per_group, stop // per_group)
    generated, per_slot = rollout.generated_groups, rollout.slot_generated
    if per_slot is not None:
        generated, per_slot = sum(per_slot[groups]), per_slot[groups]
    batch = RolloutBatch(
        prompt_ids=rb.prompt_ids[cut, rb.prompt_ids.shape[1] - prompt_width:],
        prompt_mask=rb.prompt_mask[cut, rb.prompt_mask.shape[1] - prompt_width:],
        response_ids=rb.response_ids[cut, :response_width], response_mask=rb.response_mask[cut, :response_width],
        truncated=rb.truncated[cut], response_texts=rb.response_texts[cut],
        rollout_logprobs=rb.rollout_logprobs[cut, :response_width],
        token_versions=None if rb.token_versions is None else rb.token_versions[cut, :response_width])
    return Rollout(batch=batch, task_rewards=rollout.task_rewards[cut], rewards=rollout.rewards[cut],
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
    :mod:`nemo_sspo.trainer.sampling` applied to each side).

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

    Rows are stacked with :func:`nemo_sspo.trainer.batch.concat_rollouts` (re-padded to the widest
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

    Rows are stacked with :func:`nemo_sspo.trainer.batch.concat_rollouts` (re-padded to the widest),
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


class RolloutPosition(NamedTuple):
    """Where a rollout rank's stream stands: what a free-running checkpoint keeps per rollout rank.

    Attributes:
        received: its rollouts the trainer has received (trained or dropped); the next is number
            ``received + 1`` (lock-step: the steps done).
        problems_drawn: problems it had drawn from its prompt stream by then.
    """

    received: int
    problems_drawn: int


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


@dataclass(frozen=True)
class _RolloutReplica:
    """A sampler's data-parallel view of a rollout rank: rank ``dp_rank`` of the ``dp_size`` rollout
    ranks, whose collectives run over the rollout side's default group (``dp_group`` None).
    """

    dp_size: int
    dp_rank: int
    dp_group: None = None


def rollout_replica(split: WorldSplit) -> _RolloutReplica:
    """The ``groups`` to build a rollout rank's :class:`nemo_sspo.trainer.sampling.RolloutSampler` with:
    rollout rank j of R generates slots as data-parallel rank j of R (module docstring).

    Raises:
        ValueError: ``split`` is a training rank's.
    """
    return _RolloutReplica(dp_size=split.num_rollout_ranks, dp_rank=split.rollout_index(split.rank))


class RolloutWorker:
    """A rollout rank's loop (module docstring).

    Args:
        cfg: the run's validated config (``rollout.placement == "separate"``).
        split: this rank's :class:`WorldSplit` (a rollout rank).
        engine: the rollout engine, holding the initial weights.
        sampler: a :class:`nemo_sspo.trainer.sampling.RolloutSampler` on ``engine`` built with
            ``groups=rollout_replica(split)`` (it generates this rollout rank's share of every step).
    """

    def __init__(self, cfg, split: WorldSplit, engine, sampler) -> None:  # noqa: D107
        self.cfg, self.split, self.engine, self.sampler = cfg, split, engine, sampler
        self.replica_ranks: list[int] = []  # from the start message
        self.routes: list[SlotRoute] = []  # this rank's, once the replicas are known
        self._pending: list[_Sent] = []

    def _generate_and_send(self, step: int, version: int) -> None:
        start = time.time()
        rollout = self.sampler.collect(step)
        window = (start, time.time())
        group, first = self.cfg.rollout.samples_per_prompt, self.sampler.first_slot
        for route in self.routes:
            rows = slot_rows(rollout, (route.first - first) * group, (route.stop - first) * group)
            part = VersionedRollout(rows, version, self.sampler.problems_drawn, generated=window)
            self._pending.append(send_rollout(part, dst=self.replica_ranks[route.replica], group=self.split.bridge,
                                              tag=step))

    def run(self) -> None:
        """Generates and sends every step's rollout and takes the weights after every update, lock-step
        or free-running (``rollout.staleness_schedule``, module docstring).

        Raises:
            RuntimeError: a training rank died or hung past the groups' timeout (naming it).
        """
        last, k = self.cfg.trainer.max_steps, self.cfg.rollout.max_staleness
        try:
            done, received, drawn, replicas = _recv(torch.zeros(4, dtype=torch.int64), 0, self.split.bridge,
                                                    _START_TAG).tolist()
            self.replica_ranks = _recv(torch.zeros(replicas, dtype=torch.int64), 0, self.split.bridge,
                                       _START_TAG).tolist()
        except RuntimeError as err:
            raise RuntimeError(f"training rank 0 sent no start of the run (it died or hung past the timeout): "
                               f"{err}") from err
        me, free = self.split.rollout_index(self.split.rank), self.cfg.rollout.staleness_schedule == "free"
        if not free:  # free-running rollouts all go to training rank 0
            self.routes = [route for route in slot_routes(self.cfg.rollout.prompts_per_step, replicas,
                                                          self.split.num_rollout_ranks) if route.source == me]
        if done:  # a resumed run: its weights come as a refit; generation restarts from them
            self.sampler.fast_forward(drawn)
            self.engine.load_weight_buckets(receive_weight_buckets(group=self.split.refit))
            logger.warning("resumed after step %d: generation restarts from the resumed weights (the first %d "
                           "step(s) are fresher than in an uninterrupted run with rollout.max_staleness=%d)",
                           done, min(k, last - done), k)
        if free:
            self._run_free(done, received)
            return
        generated = done
        for step in range(done + 1, last + 1):
            while generated < min(step + k, last):  # weights after step - 1's update are loaded
                generated += 1
                self._generate_and_send(generated, version=step - 1)
            self.engine.load_weight_buckets(receive_weight_buckets(group=self.split.refit))
            self._drain(keep=k + 1)
        self._drain(keep=0)

    def _run_free(self, done: int, received: int) -> None:
        """The free-running schedule (module docstring), from the weights of step ``done``, numbering
        rollouts from ``received + 1``.
        """
        ro, split = self.cfg.rollout, self.split
        if done >= self.cfg.trainer.max_steps:  # nothing left to train: the trainer expects nothing
            return
        me = split.rollout_index(split.rank)
        queue = FreeQueue(ro.max_staleness, ro.stale_policy, self.cfg.trainer.max_steps, done, received,
                          split.num_rollout_ranks)
        notices = NoticeListener(split.pairs[me], split.num_rollout_ranks)
        if ro.partial:  # responses stop at a new version and continue with its weights
            self.sampler.refits = RefitHooks(
                version=lambda: queue.version, pending=notices.ready,
                take=lambda: queue.version if self._take(notices.poll(block=True), queue, me) else None)
        while True:
            notice = notices.poll(block=not queue.may_generate())
            if notice is None:
                version, start = queue.version, time.time()  # the oldest token's version
                try:
                    rollout = self.sampler.collect(queue.sent + 1)
                except RolloutStopped:
                    break
                versioned = VersionedRollout(rollout, version, self.sampler.problems_drawn, (start, time.time()))
                self._pending.append(send_rollout(versioned, dst=0, group=split.bridge, tag=queue.record(version),
                                                  header_tag=_ROLLOUT_TAG))
            elif not self._take(notice, queue, me):
                break
        end = torch.tensor([queue.sent], dtype=torch.int64)
        self._pending.append(_Sent([end], [split.bridge.send([end], 0, _END_TAG)]))
        self._drain(keep=0)

    def _take(self, notice: Notice, queue: FreeQueue, me: int) -> bool:
        """Takes a version notice: loads the weights that follow and counts the rollouts the trainer
        has; False for the stop.
        """
        if notice.version == STOP:
            return False
        self.engine.load_weight_buckets(receive_weight_buckets(group=self.split.pairs[me]))
        self._drain(keep=queue.take_notice(notice.version, notice.taken[me]))
        return True

    def _drain(self, keep: int) -> None:
        """Waits for all but the newest ``keep`` rollouts' sends (their tensors may then be freed)."""
        per_rollout = max(1, len(self.routes))  # free-running: one send, to training rank 0
        while len(self._pending) > keep * per_rollout:
            sent = self._pending.pop(0)
            try:
                for work in sent.works:
                    work.wait()
            except RuntimeError as err:
                receivers = [self.replica_ranks[route.replica] for route in self.routes] or [0]
                raise RuntimeError(f"training ranks {receivers} took no rollout (a training rank died or hung past "
                                   f"the timeout): {err}") from err


class RolloutCollector:
    """Training rank 0's receive of free-running rollouts from every rollout rank (module docstring).

    Args:
        split: the split world (this rank is training rank 0).
        positions: each rollout rank's :class:`RolloutPosition` at the start (all zeros, or a
            resumed run's).
        peer_timeout_s: a rollout rank that sends nothing for longer while others do is named as
            dead or hung (``rollout.peer_timeout_s``).

    Attributes:
        positions: each rollout rank's position: its rollouts received (trained or dropped) and its
            data position after the last of them.
    """

    def __init__(self, split: WorldSplit, positions: list[RolloutPosition], peer_timeout_s: float) -> None:  # noqa: D107
        self.bridge, self.first, self.peer_timeout_s = split.bridge, split.num_training_ranks, peer_timeout_s
        self.sources = list(range(split.num_training_ranks, split.world_size))
        self.positions = list(positions)
        self._heard = [time.monotonic()] * len(self.sources)

    def next(self, what: str) -> tuple[int, VersionedRollout]:
        """The next rollout to arrive, from any rollout rank.

        Args:
            what: the awaited rollout, for the errors.

        Returns:
            ``(j, rollout)``: the index of the rollout rank that sent it and the rollout.

        Raises:
            RuntimeError: naming the rollout rank silent longest (it died or hung), when none sent a
                rollout within the group's timeout, or when one has sent nothing for longer than
                ``peer_timeout_s`` while the others sent; or a rollout out of its rank's order.
        """
        try:
            src, number, versioned = recv_free_rollout(group=self.bridge, sources=self.sources, what=what)
        except RuntimeError as err:
            raise self._silence(f"no rollout rank sent {what}") from err
        j = src - self.first
        if number != self.positions[j].received + 1:
            raise RuntimeError(f"rollout rank {src} sent rollout {number}, expected {self.positions[j].received + 1}")
        self.positions[j] = RolloutPosition(number, versioned.problems_drawn)
        self._heard[j] = time.monotonic()
        if max(self._silent_s()) > self.peer_timeout_s:
            raise self._silence("the others sent")
        return j, versioned

    def _silent_s(self) -> list[float]:
        now = time.monotonic()
        return [now - heard for heard in self._heard]

    def _silence(self, context: str) -> RuntimeError:
        silent = self._silent_s()
        j = max(range(len(silent)), key=silent.__getitem__)
        return RuntimeError(f"rollout rank {self.sources[j]} sent no rollout for {silent[j]:.1f} s (it died or hung "
                            f"past rollout.peer_timeout_s={self.peer_timeout_s:g}); {context}")

    def drain(self) -> int:
        """After the stop notice: receives and discards every rollout not taken, rank by rank.

        Returns:
            The number discarded.

        Raises:
            RuntimeError: naming the rollout rank, when it died or hung past the group's timeout.
        """
        discarded = 0
        for j, src in enumerate(self.sources):
            try:
                sent = int(_recv(torch.zeros(1, dtype=torch.int64), src, self.bridge, _END_TAG))
            except RuntimeError as err:
                raise RuntimeError(f"rollout rank {src} did not end its rollouts (it died or hung past the "
                                   f"timeout): {err}") from err
            for number in range(self.positions[j].received + 1, sent + 1):
                recv_free_rollout(group=self.bridge, sources=self.sources, src=src,
                                  what=f"rollout {number} (sent before the stop)")
                discarded += 1
        return discarded


class FreeRefit:
    """Training rank 0's side of the free-running refit (module docstring: what blocks what).

    Each rollout rank j takes its notices and weights over its own pair group (``split.pairs[j]``),
    whenever it is between two rollouts; one rank's post never waits for another rank.

    Args:
        split: the split world (this rank training rank 0).
    """

    def __init__(self, split: WorldSplit) -> None:  # noqa: D107
        self.pairs = split.pairs
        self.ranks = {j: split.num_training_ranks + j for j in split.pairs}  # world ranks, named in errors
        self._in_flight: dict[int, tuple[torch.Tensor, object, PendingBroadcast | None]] = {}

    def free_ranks(self) -> list[int]:
        """The rollout ranks that have taken the last version posted to them (never blocks).

        Raises:
            RuntimeError: as :meth:`wait`, when a post to one of them failed.
        """
        free = []
        for j in self.pairs:
            posted = self._in_flight.get(j)
            if posted is not None:
                _, work, weights = posted
                if not work.is_completed() or (weights is not None and not weights.is_completed()):
                    continue
                self._wait(j)  # done (or failed: raises)
            free.append(j)
        return free

    def post(self, version: int, taken: list[int], buckets, to: list[int]) -> None:
        """Posts the notice of ``version`` and its weights to rollout ranks ``to`` (free ones) without
        waiting for them; the export is encoded once, on the host, for all of them.

        Args:
            version: the policy version (the step just updated).
            taken: for each rollout rank, its rollouts the trainer has received.
            buckets: the export's HF weight buckets (drawn now; the drawing may be collective).
            to: indices of the rollout ranks to post to (from :meth:`free_ranks`).
        """
        encoded = encode_weight_buckets(buckets, torch.device("cpu"))
        for j in to:
            tensor, work = post_notice(Notice(version, tuple(taken)), group=self.pairs[j])
            self._in_flight[j] = (tensor, work, post_weight_broadcast(encoded, group=self.pairs[j],
                                                                      receivers=[self.ranks[j]]))

    def stop(self, taken: list[int]) -> float:
        """Waits for every rollout rank to take its last post, then tells each to stop.

        Returns:
            Seconds waited (the last posts and the stop notices).

        Raises:
            RuntimeError: as :meth:`wait`.
        """
        start = time.perf_counter()
        for j in self.pairs:
            self._wait(j)
            tensor, work = post_notice(Notice(STOP, tuple(taken)), group=self.pairs[j])
            self._in_flight[j] = (tensor, work, None)
        for j in self.pairs:
            self._wait(j)
        return time.perf_counter() - start

    def _wait(self, j: int) -> None:
        """Waits until rollout rank ``j`` took its last notice and weights.

        Raises:
            RuntimeError: naming it, when it did not within the group's timeout (it died or hung).
        """
        posted = self._in_flight.pop(j, None)
        if posted is None:
            return
        _, work, weights = posted
        try:
            work.wait()
        except RuntimeError as err:
            raise RuntimeError(f"rollout rank {self.ranks[j]} took no new policy version (it died or hung past "
                               f"the timeout): {err}") from err
        if weights is not None:
            weights.wait()
