"""``rollout.schedule.placement: separate``: rollout ranks generate and score while the training ranks train.

One launched world (:func:`nemo_sspo.parallel.world_split.split_world`): training ranks 0 .. T-1 run
the policy (TP x PP x DP as colocated), the last R ranks (``rollout.schedule.num_ranks``) are rollout ranks.
Each holds one engine replica, the reward pool and the prompt stream, and runs lock-step
(``rollout.schedule.max_staleness = k``, :mod:`nemo_sspo.rollouts.staleness`): it generates the rollouts of
steps 1 .. k + 1 with the initial weights, then after each step t's update receives the weights
(bucket by bucket, :mod:`nemo_sspo.parallel.weight_broadcast`; one broadcast reaches every rollout
rank) and generates step t + k + 1 while the trainer works on step t + 1.

Slots (:mod:`nemo_sspo.rollouts.sampling`): rollout rank j generates the step's prompt groups as
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

Rollouts travel as tensors over the bridge group (:func:`send_rollout` / :func:`recv_rollout`), in
the format of :mod:`nemo_sspo.rollouts.codec`, derived from the rollout dataclasses' fields: an
``int64 [2]`` prefix (the header's length and the tag of what follows), an ``int64`` header (the
tensor table and every scalar field: counts, versions, the generation window as float64 bits, text
lengths, optional fields' presence), then every tensor's bytes in field order (ids, masks, log-probs,
rewards, token versions and routes where present) and the responses' and prompt keys' utf-8 bytes in
one blob. Sends are asynchronous, so a rollout rank never waits for a trainer that is busy with an
earlier step.

``rollout.schedule.mode: free`` (:class:`nemo_sspo.rollouts.staleness.FreeQueue` decides when
to generate). Each of the R rollout ranks numbers its rollouts and generates them back to back with
the newest weights it has, each holding its P / R slots of "step" n for its number n, drawn from a
shard of the prompt stream of its own (:class:`nemo_sspo.data.ShardedSource`; no collective between
rollout ranks, so none waits for another). It sends every rollout to training rank 0, the prefix with
tag :data:`_ROLLOUT_TAG` and the header and tensors with its number. Training rank 0 receives
prefixes from any rollout rank (gloo's any-source receive) and so takes R rollouts per step in the order they arrive
(:class:`RolloutCollector`), dropping those too stale; the training ranks get the step from it.
Between two rollouts a rollout rank looks, without blocking, for a version notice
(:mod:`nemo_sspo.parallel.version_notice`) and, when one has come, takes that version's weights
bucket by bucket; with ``rollout.schedule.partial`` it also looks between two decode steps and continues the
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
when no rank sends, and a rank that sends nothing for longer than ``rollout.schedule.peer_timeout_s`` while
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
from dataclasses import replace

import torch

from nemo_sspo.parallel.version_notice import STOP, Notice, NoticeListener
from nemo_sspo.parallel.weight_broadcast import receive_weight_buckets
from nemo_sspo.parallel.world_split import WorldSplit
from nemo_sspo.rollout.partial import RolloutStopped
from nemo_sspo.rollouts.codec import _END_TAG, _ROLLOUT_TAG, _START_TAG, _Sent, _recv, send_rollout
from nemo_sspo.rollouts.producer import RolloutProducer
from nemo_sspo.rollouts.sampling import RefitHooks
from nemo_sspo.rollouts.slots import SlotRoute, slot_routes, slot_rows
from nemo_sspo.rollouts.staleness import FreeQueue

__all__ = ["RolloutWorker"]

logger = logging.getLogger(__name__)


class RolloutWorker:
    """A rollout rank's loop (module docstring).

    Args:
        cfg: the run's validated config (``rollout.schedule.placement == "separate"``).
        split: this rank's :class:`WorldSplit` (a rollout rank).
        engine: the rollout engine, holding the initial weights.
        producer: a :class:`~nemo_sspo.rollouts.producer.RolloutProducer` without fan-out, whose
            sampler runs on ``engine`` and was built with ``groups=rollout_replica(split)`` (it
            generates this rollout rank's share of every step).
    """

    def __init__(self, cfg, split: WorldSplit, engine, producer: RolloutProducer) -> None:  # noqa: D107
        self.cfg, self.split, self.engine, self.producer = cfg, split, engine, producer
        self.sampler = producer.sampler
        self.replica_ranks: list[int] = []  # from the start message
        self.routes: list[SlotRoute] = []  # this rank's, once the replicas are known
        self._pending: list[_Sent] = []

    def _generate_and_send(self, step: int, version: int) -> None:
        versioned = self.producer.produce(step, version)
        group, first = self.cfg.rollout.samples_per_prompt, self.sampler.first_slot
        for route in self.routes:
            rows = slot_rows(versioned.rollout, (route.first - first) * group, (route.stop - first) * group)
            part = replace(versioned, rollout=rows)
            self._pending.append(send_rollout(part, dst=self.replica_ranks[route.replica], group=self.split.bridge,
                                              tag=step))

    def run(self) -> None:
        """Generates and sends every step's rollout and takes the weights after every update, lock-step
        or free-running (``rollout.schedule.mode``, module docstring).

        Raises:
            RuntimeError: a training rank died or hung past the groups' timeout (naming it).
        """
        last, k = self.cfg.trainer.max_steps, self.cfg.rollout.schedule.max_staleness
        try:
            done, received, drawn, replicas = _recv(torch.zeros(4, dtype=torch.int64), 0, self.split.bridge,
                                                    _START_TAG).tolist()
            self.replica_ranks = _recv(torch.zeros(replicas, dtype=torch.int64), 0, self.split.bridge,
                                       _START_TAG).tolist()
        except RuntimeError as err:
            raise RuntimeError(f"training rank 0 sent no start of the run (it died or hung past the timeout): "
                               f"{err}") from err
        me, free = self.split.rollout_index(self.split.rank), self.cfg.rollout.schedule.mode == "free"
        if not free:  # free-running rollouts all go to training rank 0
            self.routes = [route for route in slot_routes(self.cfg.rollout.prompts_per_step, replicas,
                                                          self.split.num_rollout_ranks) if route.source == me]
        if done:  # a resumed run: its weights come as a refit; generation restarts from them
            self.sampler.fast_forward(drawn)
            self.engine.load_weight_buckets(receive_weight_buckets(group=self.split.refit))
            logger.warning("resumed after step %d: generation restarts from the resumed weights (the first %d "
                           "step(s) are fresher than in an uninterrupted run with rollout.schedule.max_staleness=%d)",
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
        queue = FreeQueue(ro.schedule.max_staleness, ro.schedule.stale_policy, self.cfg.trainer.max_steps, done,
                          received, split.num_rollout_ranks)
        notices = NoticeListener(split.pairs[me], split.num_rollout_ranks)
        if ro.schedule.partial:  # responses stop at a new version and continue with its weights
            self.sampler.refits = RefitHooks(
                version=lambda: queue.version, pending=notices.ready,
                take=lambda: queue.version if self._take(notices.poll(block=True), queue, me) else None)
        while True:
            notice = notices.poll(block=not queue.may_generate())
            if notice is None:
                try:  # its version: the oldest token's
                    versioned = self.producer.produce(queue.sent + 1, queue.version)
                except RolloutStopped:
                    break
                self._pending.append(send_rollout(versioned, dst=0, group=split.bridge, tag=queue.record(versioned.version),
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
