"""One DiLoCo participant: the training-thread state machine behind the callback.

``DiLoCoNode.on_step`` is called once per optimizer step (the ``coordinate`` event). It
never waits for the network; uploads, polls and master rounds run on bounded background
lanes and report back through inboxes that ``on_step`` drains.

Per step, in this order:

1. drain the lanes' results (confirmed uploads, fetched globals, master rounds);
2. at a boundary (``step % inner_steps == 0``): fold the progress since the baseline into
   the pending delta and hand it to the upload lane -- **upload first**;
3. if a newer global arrived: fold any progress not yet sent into the pending delta, then
   install the global *plus* that unsent progress (the hub-mode **delta-carry rule**,
   ``weights <- global - pending``, the same rule as streaming's): the node keeps building
   on its own work instead of dropping it from its weights, and sends it at the next
   boundary, now based on the installed global. Returns the installed outer step so the
   callback can ask for an optimizer reset -- only for an accepted (installed) sync;
4. schedule background work that is due (poll / master round).

Streaming (``fragments`` P > 1, docs/distributed.md "Streaming"): the boundaries are those
of ``fragments.FragmentPlan`` -- fragment ``p`` at every step ``s`` with ``s % H`` equal to
its offset -- and each sends only its fragment's keys of the pending delta (a file with a
``fragment`` field ``"p/P"``); the other keys' progress stays pending until their own
boundary. A fragment's upload is one file: retried whole (as the unconfirmed job, before
any new work) and validated whole by the master, so it is never half-applied.

Exactly-once delivery: an upload that fails is re-sent later with the *same* content
(the file name carries its content hash and the master dedupes by content hash), never
merged into a later delta, so a "failed" upload that actually reached the hub is not
applied twice. Every delta carries its step range (``first_step``, ``local_step``: the
local steps whose progress it holds), and the master applies no two deltas of one node
incarnation whose ranges overlap.

Resume (``_finish_startup``): a node resumed from a checkpoint at step ``c`` asks the hub
what it had already sent after ``c`` -- per fragment, the highest local step of this
incarnation that the master applied (the pointer's ``covered``) or that still waits under
``nodes/<id>/`` (read from those files' signed headers). Training then recomputes steps
``c + 1 ..`` from the checkpoint; the progress of every step up to what was sent is
already on the hub, so the node drops it -- its checkpointed unsent work, and the progress
and the tokens of the recomputed steps up to that step (``PendingWork.drop_sent``) -- and
uploads only what comes after. The recomputed progress leaves the weights at the next install (the
delta-carry rule carries only the pending delta).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from speedtronic_callbacks.diloco.codec import Codec
from speedtronic_callbacks.diloco.codecs import FP32
from speedtronic_callbacks.diloco.fragments import layout_plan
from speedtronic_callbacks.diloco.lanes import ErrorReporter, Lane
from speedtronic_callbacks.diloco.master import MasterLoop
from speedtronic_callbacks.diloco.math import carry, pseudo_gradient
from speedtronic_callbacks.diloco.model_layout import ModelLayout
from speedtronic_callbacks.diloco.node_jobs import NodeJobs
from speedtronic_callbacks.diloco.node_messages import (
    GlobalCandidate,
    MasterEvent,
    NodeStats,
    PollResult,
    SyncOutcome,
    UploadJob,
    UploadResult,
)
from speedtronic_callbacks.diloco.node_pending import PendingWork, all_finite, snapshot_weights
from speedtronic_callbacks.diloco.node_results import LaneResults
from speedtronic_callbacks.diloco.node_state import (
    STATE_FORMAT,
    integer_field,
    node_metrics,
    optional_tensors,
    restore_unsent,
    text_field,
    unsent_state,
)
from speedtronic_callbacks.diloco.transport_base import (
    RetryingTransport,
)
from speedtronic_callbacks.diloco.wire import (
    expand_aliases,
    largest_file_bytes,
)

# The lanes' messages (``node_messages``) and the state format are re-exported: their
# import path before the node was split by concept.
__all__ = [
    "STATE_FORMAT",
    "DiLoCoNode",
    "GlobalCandidate",
    "MasterEvent",
    "NodeSettings",
    "NodeStats",
    "PollResult",
    "SyncOutcome",
    "UploadJob",
    "UploadResult",
]

logger = logging.getLogger("speedtronic.diloco")


_Role = Literal["master", "worker"]


@dataclass(frozen=True)
class NodeSettings:
    """Node-side knobs (see the callback options for meaning and defaults)."""

    node_id: str
    role: _Role
    inner_steps: int = 500
    poll_interval: float = 60.0
    compression: Codec = FP32
    """The codec ``compression`` names (its older option; ``delta_dtype`` wins)."""
    shutdown_timeout: float = 5.0
    secret: bytes | None = field(default=None, repr=False)
    max_file_bytes: int | None = None
    """Largest hub file read; ``None``: derived from the model (``largest_file_bytes``)."""
    delta_dtype: Codec | None = None
    """The delta codec (``None``: the one ``compression`` names)."""
    error_feedback: bool = True
    """Carry what a lossy encoding dropped into the next delta."""
    fragments: int = 1
    """Streaming fragments P (1: the whole model at every boundary)."""

    @property
    def encoding(self) -> Codec:
        return self.delta_dtype or self.compression


def _ignore(event: str, payload: Mapping[str, object]) -> None:
    """The default event sink: nobody listens."""


class DiLoCoNode:
    """Worker (or master) side of DiLoCo for one model. Not thread-safe by itself: every
    public method except the lane jobs runs on the training thread."""

    def __init__(
        self,
        model: nn.Module,
        transport: RetryingTransport,
        layout: ModelLayout,
        settings: NodeSettings,
        *,
        master: MasterLoop | None = None,
        reporter: ErrorReporter | None = None,
        clock: Callable[[], float] = time.monotonic,
        publish: Callable[[str, Mapping[str, object]], None] | None = None,
    ) -> None:
        if settings.inner_steps < 1:
            raise ValueError(f"inner_steps must be >= 1, got {settings.inner_steps}")
        if (master is not None) != (settings.role == "master"):
            raise ValueError("a master node needs a MasterLoop and a worker must not have one")
        self.model = model
        self.transport = transport
        self.layout = layout
        self.settings = settings
        self.plan = layout_plan(layout, settings.fragments, settings.inner_steps)
        self.master = master
        self.reporter = reporter or ErrorReporter()
        self._clock = clock
        self._publish = publish or _ignore
        """Where the 2.0 events go (``outer_step``, ``delta_upload_*``): the trainer's notes."""
        self.installed_step = -1
        self.installed_global: Mapping[str, torch.Tensor] | None = None
        """The global model last installed (the weights hold it plus unsent progress)."""
        self.baseline: dict[str, torch.Tensor] | None = None
        self._baseline_step = 0
        """The step the baseline was taken at (the start of the segment being trained)."""
        self.unsent = PendingWork(layout, self.plan, master)
        """The unsent work: the pending delta, held-back and unconfirmed work, ranges."""
        self._resync = False
        self._captured_step: int | None = None
        self._last_step = 0
        self.stats = NodeStats()
        self.jobs = NodeJobs(transport, layout, settings, master, self.reporter, clock)
        """The lanes and the background jobs they run (upload, poll, master rounds)."""
        self.results = LaneResults(
            model,
            layout,
            settings,
            self.plan,
            master,
            self.jobs,
            self.unsent,
            self.stats,
            clock,
            self._publish,
        )
        """What the lanes delivered (the global to install) and what is due next."""
        self._started = False
        transport.limit_file_size(settings.max_file_bytes or largest_file_bytes(layout))

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._started

    @property
    def pending(self) -> dict[str, torch.Tensor] | None:
        """The progress not sent yet (every synchronised key; ``None``: nothing)."""
        return self.unsent.pending

    @property
    def pending_base(self) -> int:
        return self.unsent.pending_base

    @property
    def pending_work(self) -> tuple[int, int]:
        return self.unsent.pending_work

    @property
    def unconfirmed(self) -> UploadJob | None:
        return self.unsent.unconfirmed

    def record_work(self, tokens: int, samples: int) -> None:
        """The trainer's token and sample counters now (called before ``on_step``)."""
        self.unsent.record_work(tokens, samples)

    @property
    def incarnation(self) -> str:
        """This node life's name on the hub (renewed when another process sends as it)."""
        return self.jobs.incarnation

    @property
    def master_lane(self) -> Lane:
        return self.jobs.master_lane

    def start(self, step: int) -> None:
        """Open the lanes and schedule the start-up work (master reconcile, first poll)."""
        if self._started:
            return
        if self.master is not None:
            self.master.claim()
        self.jobs.open()
        self._last_step = step
        if self.baseline is None:
            self.baseline = snapshot_weights(self.model, self.layout.sync_keys)
            self._baseline_step = step
        if self.unsent.range_starts is None:
            self.unsent.range_starts = [step] * self.plan.count
        if self.unsent.work_step is None:
            self.unsent.work_step = step
        self._started = True
        self.results.schedule(step, True, self.installed_step)

    def stop(self) -> None:
        """Give the upload in flight ``shutdown_timeout`` s to finish, then cancel every
        retry wait and stop the lanes. Never raises."""
        if not self._started:
            return
        master_idle = self.jobs.close(self.settings.shutdown_timeout)
        self.results.drain(self._last_step)
        if self.master is not None and master_idle:
            self.master.release()
        self._started = False

    def wait_idle(self, timeout: float) -> bool:
        """Block until every lane is idle, then process their results (for tests and
        benchmarks that need a settled state; training never calls it)."""
        idle = self.jobs.wait_idle(timeout)
        self.results.drain(self._last_step)
        return idle

    # -- checkpoint and metrics --------------------------------------------------------

    def state_dict(self) -> dict[str, object]:
        """Everything needed to resume (tensors, numbers, strings, lists, dicts, None)."""
        return {
            "format": STATE_FORMAT,
            "node_id": self.settings.node_id,
            "role": self.settings.role,
            "incarnation": self.jobs.incarnation,
            "installed_outer_step": self.installed_step,
            "checkpoint_step": self._last_step,
            "baseline": self.baseline,
            **unsent_state(self.unsent),
            "master": {} if self.master is None else self.master.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore a checkpoint (before ``start``); the unsent work as ``restore_unsent``
        says."""
        if not state:
            return
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"diloco state format {state.get('format')!r} is not supported")
        master_state = state.get("master")
        if self.master is not None and isinstance(master_state, Mapping):
            self.master.load_state_dict(master_state)
        if state.get("node_id") != self.settings.node_id:
            logger.warning(
                "diloco checkpoint belongs to node %r, this is %r: starting this node fresh",
                state.get("node_id"),
                self.settings.node_id,
            )
            return
        self.jobs.incarnation = text_field(state, "incarnation")
        self.installed_step = integer_field(state, "installed_outer_step")
        self.baseline = optional_tensors(state, "baseline", self.layout)
        checkpoint_step = restore_unsent(self.unsent, state, self.layout, self.plan.count)
        self._baseline_step = checkpoint_step  # the baseline is from this step or before
        self.results.resume(checkpoint_step)
        self._captured_step = None

    def metrics(self) -> dict[str, int | float]:
        """Cumulative counters plus the last round's figures (``diloco/`` keys)."""
        return node_metrics(
            self.stats,
            self.installed_step,
            self.transport,
            self.reporter.errors,
            self.master is not None,
        )

    # -- the per-step entry point ------------------------------------------------------

    def on_step(self, step: int) -> SyncOutcome:
        """Called after every optimizer step with the trainer's absolute step number."""
        if not self._started:
            raise RuntimeError("DiLoCoNode.start must be called before on_step")
        self._last_step = step
        self.results.drain(self._last_step)
        due = self.plan.due(step)
        boundary = bool(due)
        dispatched = False
        if boundary:
            self._capture(step)
            for fragment in due:
                dispatched = self._dispatch(step, fragment) or dispatched
        installed = self._install_candidate(step)
        self.results.schedule(step, boundary, self.installed_step)
        return SyncOutcome(dispatched=dispatched, installed=installed)

    # -- progress bookkeeping ----------------------------------------------------------

    def _capture(self, step: int) -> None:
        """Fold ``baseline - current`` into the pending delta; the current weights become
        the baseline. Idempotent within a step."""
        if self._captured_step == step:
            return
        assert self.baseline is not None  # set by start()
        current = snapshot_weights(self.model, self.layout.sync_keys)
        segment = pseudo_gradient(self.baseline, current, self.layout.sync_keys)
        work = self.unsent.take_work(step)
        if self.unsent.skip is not None:
            segment, work = self.unsent.drop_sent(segment, work, step, self._baseline_step)
        self.unsent.add(segment, self.installed_step, work)
        self.baseline = current
        self._baseline_step = step
        self._captured_step = step

    def _dispatch(self, step: int, fragment: int = 0) -> bool:
        """Hand the unconfirmed job (a resend, whatever its fragment) or ``fragment``'s
        share of the pending delta to the upload lane."""
        if self.installed_step < 0 or self._resync or not self.results.startup_done:
            return False  # no global yet, or start-up reconciliation still open
        if self.jobs.upload_lane.busy:
            self.stats.boundaries_skipped += 1
            self._publish("delta_upload_skipped", {"step": step, "reason": "upload_in_flight"})
            return False  # the next boundary sends a cumulative delta
        job = self.unsent.unconfirmed
        if job is None:
            pending = self.unsent.pending
            if pending is None:
                return False
            if not all_finite(pending):
                logger.error(
                    "diloco node %s: local weights are NaN/Inf at step %d; this delta is "
                    "dropped and the node resynchronises from the next global",
                    self.settings.node_id,
                    step,
                )
                self.unsent.drop(step)
                self._resync = True
                self.stats.resyncs += 1
                return False
            base, work = self.unsent.pending_base, self.unsent.pending_work
            taken = self.unsent.take_fragment(fragment)
            if taken is None:
                return False
            if self.unsent.pending is not None:  # a fragment: the work so far travels with it
                self.unsent.pending_work = (0, 0)
            assert self.unsent.range_starts is not None  # set by start()
            job = UploadJob(
                taken[0], step, base, *work, taken[1], self.unsent.range_starts[fragment]
            )
            self.unsent.range_starts[fragment] = step
            self.unsent.dispatched_through = max(self.unsent.dispatched_through, step)
            self.unsent.unconfirmed = job
        submitted = self.jobs.submit_upload(job)
        if not submitted:
            self.stats.boundaries_skipped += 1
            self._publish("delta_upload_skipped", {"step": step, "reason": "queue_full"})
        else:
            self._publish(
                "delta_upload_queued",
                {"step": job.local_step, "base_outer_step": job.base_outer_step},
            )
        return submitted

    def _install_candidate(self, step: int) -> int | None:
        candidate = self.results.take_candidate()
        if candidate is None or candidate.outer_step <= self.installed_step:
            return None
        if self._resync:
            # Our unsent progress is NaN/Inf: drop it.
            self.unsent.drop(step)
            self._resync = False
        else:
            self._capture(step)  # keep progress not yet sent: it goes out at the next boundary
            if self.installed_step < 0 and not self._started_from(candidate):
                # First global, and it is not the weights this node started from (another
                # seed): progress measured from those weights means nothing to the hub.
                self.unsent.drop(step)
        state = dict(candidate.state)
        if self.unsent.pending is not None:
            # The delta-carry rule: the weights become the global plus the progress the hub
            # does not have yet, and that progress now stands on this global (its base).
            # Installing the bare global instead would throw the node's unsent work out of
            # its weights, to come back only at outer_lr x staleness weight a round later.
            state.update(carry(candidate.state, self.unsent.pending))
            self.unsent.pending_base = candidate.outer_step
        full = expand_aliases(state, self.layout)
        with torch.no_grad():
            self.model.load_state_dict(full, strict=True)
        self.baseline = {key: state[key] for key in self.layout.sync_keys}
        self._baseline_step = step
        self.installed_global = candidate.state
        self._captured_step = step
        self.installed_step = candidate.outer_step
        self.stats.installs += 1
        logger.info(
            "diloco node %s installed global outer step %d at local step %d",
            self.settings.node_id,
            candidate.outer_step,
            step,
        )
        return candidate.outer_step

    @contextmanager
    def holding_global(self) -> Iterator[None]:
        """The model holds the installed global model exactly inside the block (not the
        global plus the progress carried at the install), and its own weights again after
        it: what evaluates "the global model" (the master's ``diloco/eval_global``)."""
        installed = self.installed_global
        state = self.model.state_dict()
        if installed is None or all(
            torch.equal(state[key], installed[key]) for key in self.layout.sync_keys
        ):
            yield
            return
        own = {key: value.detach().clone() for key, value in state.items()}
        with torch.no_grad():
            self.model.load_state_dict(expand_aliases(installed, self.layout), strict=True)
        try:
            yield
        finally:
            with torch.no_grad():
                self.model.load_state_dict(own, strict=True)

    def _started_from(self, candidate: GlobalCandidate) -> bool:
        """Whether ``baseline + pending`` (the weights this node started from) equals the
        candidate global, up to float32 rounding of the reconstruction."""
        assert self.baseline is not None
        for key in self.layout.sync_keys:
            origin = self.baseline[key].to(torch.float32)
            if self.unsent.pending is not None:
                origin = origin + self.unsent.pending[key]
            target = candidate.state[key].to(torch.float32)
            if not torch.allclose(origin, target, rtol=1e-5, atol=1e-6):
                return False
        return True
