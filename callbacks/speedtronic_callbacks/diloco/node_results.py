"""How a DiLoCo node takes in its lanes' results on the training thread (``node``, step
1 and 4): confirmed or failed uploads, fetched globals, master rounds, the resume
hand-shake with the hub (``_finish_startup``), and scheduling the next poll or round;
a component the node holds (``DiLoCoNode.results``)."""

from __future__ import annotations

import logging
import math as pymath
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from speedtronic_callbacks.diloco.fragments import FragmentPlan
from speedtronic_callbacks.diloco.master import MasterLoop, RoundReport
from speedtronic_callbacks.diloco.model_layout import ModelLayout
from speedtronic_callbacks.diloco.node_jobs import NodeJobs
from speedtronic_callbacks.diloco.node_messages import GlobalCandidate, NodeStats
from speedtronic_callbacks.diloco.node_pending import PendingWork, all_zero, merge_held
from speedtronic_callbacks.diloco.wire import (
    global_tensors,
)

if TYPE_CHECKING:
    from speedtronic_callbacks.diloco.node import NodeSettings

logger = logging.getLogger("speedtronic.diloco")


class LaneResults:
    """What a node takes in from its lanes and what it asks of them next, on the training
    thread: confirmed or failed uploads, the newest global offered (``candidate``, taken
    by the install), master rounds, the resume hand-shake (``startup_done``), and when
    the next poll or master round is due (``schedule``)."""

    def __init__(
        self,
        model: nn.Module,
        layout: ModelLayout,
        settings: NodeSettings,
        plan: FragmentPlan,
        master: MasterLoop | None,
        jobs: NodeJobs,
        unsent: PendingWork,
        stats: NodeStats,
        clock: Callable[[], float],
        publish: Callable[[str, Mapping[str, object]], None],
    ) -> None:
        self.model = model
        self.layout = layout
        self.settings = settings
        self.plan = plan
        self.master = master
        self.jobs = jobs
        self.unsent = unsent
        self.stats = stats
        self._clock = clock
        self._publish = publish
        self.candidate: GlobalCandidate | None = None
        """The newest global offered and not installed yet."""
        self.startup_done = True
        """Whether the hub answered what this node sent after its checkpoint (``resume``)."""
        self.checkpoint_step: int | None = None
        self._foreign_logged = False
        self._last_step = 0
        self._last_poll = -pymath.inf
        self._last_round = -pymath.inf

    @property
    def acts_as_master(self) -> bool:
        return self.master is not None and self.master.halted is None

    def resume(self, checkpoint_step: int) -> None:
        """A checkpoint at ``checkpoint_step`` was restored: ask the hub what this node sent
        after it before sending anything (``_finish_startup``)."""
        self.checkpoint_step = checkpoint_step
        self.startup_done = False

    def take_candidate(self) -> GlobalCandidate | None:
        candidate, self.candidate = self.candidate, None
        return candidate

    def drain(self, last_step: int) -> None:
        """Take in every result delivered so far (``last_step``: the step trained last)."""
        self._last_step = last_step
        for result in self.jobs.uploads.drain():
            if result.error is None:
                if self.unsent.unconfirmed is result.job:
                    self.unsent.unconfirmed = None
                if result.residual is not None:
                    self.unsent.add(result.residual, result.job.base_outer_step)
                self.stats.uploads += 1
                self.stats.sync_latency_s = result.latency_s
                self._publish("delta_uploaded", {"step": result.job.local_step})
            else:
                self.stats.upload_failures += 1  # the same job is re-sent at the next boundary
                self._publish(
                    "delta_upload_failed", {"step": result.job.local_step, "error": result.error}
                )
        for poll in self.jobs.polls.drain():
            if not poll.ok:
                continue
            if poll.pointer_step is not None:
                self.stats.hub_outer_step = max(self.stats.hub_outer_step, poll.pointer_step)
            if poll.sent is not None and not self.startup_done:
                self._finish_startup(poll.sent)
            if poll.progress is not None and self.startup_done:
                self._check_own_progress(*poll.progress)
            self._offer(poll.candidate)
        for event in self.jobs.rounds.drain():
            self._offer(event.candidate)
            if event.report is None:
                self._last_round = -pymath.inf  # reconciled: the first round may run now
            else:
                self._record_round(event.report)

    def _offer(self, candidate: GlobalCandidate | None) -> None:
        if candidate is None:
            return
        self.stats.hub_outer_step = max(self.stats.hub_outer_step, candidate.outer_step)
        if self.candidate is None or candidate.outer_step > self.candidate.outer_step:
            self.candidate = candidate

    def _record_round(self, report: RoundReport) -> None:
        stats = self.stats
        stats.rounds += 1
        stats.last_round = report
        stats.deltas_found += report.found
        stats.deltas_included += report.included
        stats.deltas_rejected += len(report.rejected)
        stats.deltas_duplicate += report.duplicates
        self._publish(
            "outer_step",
            {
                "outer_step": report.outer_step,
                "deltas_found": report.found,
                "deltas_included": report.included,
            },
        )

    def _finish_startup(self, sent: Mapping[str, int]) -> None:
        """Decide what to do with checkpointed, unsent work once the hub answered what this
        node had sent after its checkpoint (``_sent_after``): nothing -- the checkpointed
        work goes out at the next boundary; something -- that work, and the recomputed
        progress up to what was sent, is dropped per fragment (``PendingWork.skip``,
        ``PendingWork.drop_sent``)."""
        unsent = self.unsent
        held, unsent.held_pending = unsent.held_pending, None
        skip = self._skip_plan(sent)
        if not skip:
            if held is not None:
                unsent.add(held, unsent.held_base, unsent.held_work)
            self.startup_done = True
            return
        through = max(sent.values())
        logger.info(
            "diloco node %s: the hub already has this node's work up to local step %d "
            "(after its checkpoint at step %s); that work and its recomputation are not "
            "sent again",
            self.settings.node_id,
            through,
            self.checkpoint_step,
        )
        merged = merge_held(held, unsent.pending)
        pending = None if merged is None else dict(merged)  # a checkpoint may share the old
        assert unsent.range_starts is not None  # set by start()
        for fragment in skip:
            if pending is not None:
                for key in self.plan.fragments[fragment]:
                    pending[key] = torch.zeros_like(pending[key])
            unsent.range_starts[fragment] = self._last_step
        bases = [
            base
            for base, part in (
                (unsent.held_base, held),
                (unsent.pending_base, unsent.pending),
            )
            if part is not None
        ]
        unsent.pending = None if pending is None or all_zero(pending) else pending
        unsent.pending_base = min(bases, default=unsent.pending_base)
        unsent.pending_work = (0, 0)  # reported with what was sent
        unsent.skip, unsent.skip_work = skip, through
        unsent.dispatched_through = max(unsent.dispatched_through, through)
        self.stats.resyncs += 1
        self.startup_done = True

    def _skip_plan(self, sent: Mapping[str, int]) -> dict[int, int]:
        """Per fragment of this node's plan, the local step through which its progress
        was sent (``sent`` after ``_sent_after``); a field that is not one of this plan's
        (``"*"``, or a fragment count this node no longer uses) counts for every fragment."""
        names = [self.plan.name(p) for p in range(self.plan.count)]
        fallback = max((step for name, step in sent.items() if name not in names), default=-1)
        plan = {p: max(sent.get(name, -1), fallback) for p, name in enumerate(names)}
        return {p: step for p, step in plan.items() if step >= 0}

    def _check_own_progress(self, incarnation: str, step: int) -> None:
        """The hub says a delta of this incarnation ending at ``step`` was applied, but this
        node never dispatched one that far: someone else sends under this node id (a
        second process with the same id, or a holder of the signing secret). Its deltas
        would make the master refuse this node's next ones as overlapping, so the node
        continues under a new incarnation, and says so once."""
        if incarnation != self.jobs.incarnation or step <= self.unsent.dispatched_through:
            return
        if not self._foreign_logged:
            logger.error(
                "diloco node %s: the hub applied a delta of this node (incarnation %s) for "
                "local step %d, but this node has sent only up to step %d: another process "
                "uses node id %r, or someone with the signing secret wrote it; this node "
                "continues under a new incarnation (give every node its own node_id)",
                self.settings.node_id,
                incarnation,
                step,
                self.unsent.dispatched_through,
                self.settings.node_id,
            )
            self._foreign_logged = True
        self.jobs.incarnation = uuid.uuid4().hex[:12]

    def schedule(self, step: int, boundary: bool, installed_step: int) -> None:
        """Submit the poll or master round that is due (a lane still busy: later)."""
        now = self._clock()
        master = self.master
        jobs = self.jobs
        if master is not None and self.acts_as_master and not jobs.master_lane.busy:
            if now - self._last_round >= self.settings.poll_interval:
                self._last_round = now
                if master.reconciled:
                    jobs.submit_round()
                else:
                    initial = global_tensors(self.model.state_dict(), self.layout)
                    jobs.submit_reconcile(
                        {k: v.detach().to("cpu", copy=True) for k, v in initial.items()}
                    )
        fetch = not self.acts_as_master
        if not fetch and self.startup_done:
            return  # a master gets its globals in-process
        if jobs.poll_lane.busy or not (
            boundary or now - self._last_poll >= self.settings.poll_interval
        ):
            return
        self._last_poll = now
        installed = installed_step
        seen = max(installed, self.stats.hub_outer_step)
        checkpoint_step = None if self.startup_done else self.checkpoint_step
        jobs.submit_poll(installed, seen, fetch, checkpoint_step)
