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
and the tokens of the recomputed steps up to that step (``_drop_sent``) -- and uploads only
what comes after. The recomputed progress leaves the weights at the next install (the
delta-carry rule carries only the pending delta).
"""

from __future__ import annotations

import logging
import math as pymath
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from speedtronic_callbacks.diloco.codec import Codec
from speedtronic_callbacks.diloco.codecs import FP32
from speedtronic_callbacks.diloco.fragments import layout_plan
from speedtronic_callbacks.diloco.hub_files import delta_path, parse_delta_path
from speedtronic_callbacks.diloco.lanes import ErrorReporter, Inbox, Lane
from speedtronic_callbacks.diloco.master import MasterConflictError, MasterLoop, RoundReport
from speedtronic_callbacks.diloco.math import carry, pseudo_gradient
from speedtronic_callbacks.diloco.model_layout import ModelLayout
from speedtronic_callbacks.diloco.pointer import POINTER_PATH, Pointer, decode_pointer
from speedtronic_callbacks.diloco.transport_base import (
    RetryingTransport,
    TransportError,
    UnreadableFileError,
)
from speedtronic_callbacks.diloco.wire import (
    DeltaInfo,
    Rejected,
    check_signature,
    decode_global,
    encode_wire,
    expand_aliases,
    fragment_layout,
    fragment_shapes,
    from_wire,
    global_tensors,
    largest_file_bytes,
    metadata_fields,
    parse_header,
    to_wire,
)

logger = logging.getLogger("speedtronic.diloco")

STATE_FORMAT = 1

Role = Literal["master", "worker"]


@dataclass(frozen=True)
class NodeSettings:
    """Node-side knobs (see the callback options for meaning and defaults)."""

    node_id: str
    role: Role
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


@dataclass(frozen=True)
class UploadJob:
    """An immutable delta to send. Re-sending it produces the same content hash.
    ``tokens``/``samples``: what the node trained for it (0: not counted)."""

    delta: dict[str, torch.Tensor]
    local_step: int
    base_outer_step: int
    tokens: int = 0
    samples: int = 0
    fragment: str = ""
    """``"p/P"`` for a streaming fragment's keys, ``""`` for the whole model."""
    first_step: int | None = None
    """The start of the job's step range: it holds the progress of steps after it."""


@dataclass(frozen=True)
class UploadResult:
    """``residual`` is what bf16/fp16 rounding dropped from the job; it is added to the
    next delta once the upload is confirmed (error feedback), so compression loses
    nothing over time."""

    job: UploadJob
    path: str | None
    size: int
    latency_s: float
    error: str | None
    residual: dict[str, torch.Tensor] | None = None


@dataclass(frozen=True)
class GlobalCandidate:
    outer_step: int
    state: Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class PollResult:
    """A poll's outcome. ``sent`` answers the start-up question "what did this node
    already send after its checkpoint?": per streaming fragment (``""``: whole-model
    deltas, ``"*"``: unknown), the highest local step (``None`` when it was not asked).
    ``progress``: the pointer's (incarnation, highest local step applied) of this node."""

    ok: bool
    pointer_step: int | None = None
    candidate: GlobalCandidate | None = None
    sent: Mapping[str, int] | None = None
    latency_s: float = 0.0
    progress: tuple[str, int] | None = None


@dataclass(frozen=True)
class MasterEvent:
    candidate: GlobalCandidate | None
    report: RoundReport | None


@dataclass(frozen=True)
class SyncOutcome:
    """What ``on_step`` did: a delta handed to the upload lane, a global installed."""

    dispatched: bool = False
    installed: int | None = None


@dataclass
class NodeStats:
    uploads: int = 0
    upload_failures: int = 0
    boundaries_skipped: int = 0
    installs: int = 0
    resyncs: int = 0
    sync_latency_s: float = 0.0
    hub_outer_step: int = -1
    rounds: int = 0
    last_round: RoundReport | None = None
    deltas_found: int = 0
    deltas_included: int = 0
    deltas_rejected: int = 0
    deltas_duplicate: int = 0


def _ignore(event: str, payload: Mapping[str, object]) -> None:
    """The default event sink: nobody listens."""


def _snapshot(model: nn.Module, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    return {key: state[key].detach().to("cpu", copy=True) for key in keys}


def _all_zero(delta: Mapping[str, torch.Tensor]) -> bool:
    return not any(bool(t.any()) for t in delta.values())


def _all_finite(delta: Mapping[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in delta.values())


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
        self.incarnation = uuid.uuid4().hex[:12]
        self.installed_step = -1
        self.installed_global: Mapping[str, torch.Tensor] | None = None
        """The global model last installed (the weights hold it plus unsent progress)."""
        self.baseline: dict[str, torch.Tensor] | None = None
        self.pending: dict[str, torch.Tensor] | None = None
        self.pending_base = -1
        self.pending_work = (0, 0)
        """Tokens and samples trained for ``pending`` (sent with it as upload metadata)."""
        self._work_now = (0, 0)
        self._work_mark = (0, 0)
        self._held_work = (0, 0)
        self.unconfirmed: UploadJob | None = None
        self._held_pending: dict[str, torch.Tensor] | None = None
        self._held_base = -1
        self._checkpoint_step: int | None = None
        self._range_starts: list[int] | None = None
        """Per fragment, the step after which its pending progress begins (its next
        delta's ``first_step``)."""
        self._baseline_step = 0
        """The step the baseline was taken at (the start of the segment being trained)."""
        self._skip: dict[int, int] | None = None
        """Per fragment, the local step through which an earlier life of this node sent
        its progress (set on resume; ``_drop_sent``)."""
        self._skip_work = -1
        """The step through which that earlier life reported its tokens and samples."""
        self._dispatched_through = -1
        """The highest local step of a delta this incarnation handed to the upload lane."""
        self._work_step: int | None = None
        """The step ``_work_mark`` was taken at (the master measures its step's work)."""
        self._foreign_logged = False
        self._startup_done = True
        self._resync = False
        self._candidate: GlobalCandidate | None = None
        self._captured_step: int | None = None
        self._last_step = 0
        self._last_poll = -pymath.inf
        self._last_round = -pymath.inf
        self.upload_lane = Lane("upload")
        self.poll_lane = Lane("poll")
        self.master_lane = Lane("master")
        self._uploads: Inbox[UploadResult] = Inbox()
        self._polls: Inbox[PollResult] = Inbox()
        self._rounds: Inbox[MasterEvent] = Inbox()
        self.stats = NodeStats()
        self._started = False
        self._replays_logged: set[tuple[int, int]] = set()
        transport.limit_file_size(settings.max_file_bytes or largest_file_bytes(layout))

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._started

    @property
    def acts_as_master(self) -> bool:
        return self.master is not None and self.master.halted is None

    def start(self, step: int) -> None:
        """Open the lanes and schedule the start-up work (master reconcile, first poll)."""
        if self._started:
            return
        if self.master is not None:
            self.master.claim()
        self.transport.cancel.clear()
        for lane in (self.upload_lane, self.poll_lane, self.master_lane):
            lane.open()
        self._last_step = step
        if self.baseline is None:
            self.baseline = _snapshot(self.model, self.layout.sync_keys)
            self._baseline_step = step
        if self._range_starts is None:
            self._range_starts = [step] * self.plan.count
        if self._work_step is None:
            self._work_step = step
        self._started = True
        self._schedule(step, boundary=True)

    def stop(self) -> None:
        """Give the upload in flight ``shutdown_timeout`` s to finish, then cancel every
        retry wait and stop the lanes. Never raises."""
        if not self._started:
            return
        timeout = self.settings.shutdown_timeout
        self.upload_lane.close(timeout)
        self.transport.cancel.set()
        master_idle = self.master_lane.close(timeout)
        self.poll_lane.close(timeout)
        self._drain()
        if self.master is not None and master_idle:
            self.master.release()
        self._started = False

    def wait_idle(self, timeout: float) -> bool:
        """Block until every lane is idle, then process their results (for tests and
        benchmarks that need a settled state; training never calls it)."""
        deadline = time.monotonic() + timeout
        idle = all(
            lane.wait_idle(max(0.0, deadline - time.monotonic()))
            for lane in (self.upload_lane, self.poll_lane, self.master_lane)
        )
        self._drain()
        return idle

    # -- the per-step entry point ------------------------------------------------------

    def on_step(self, step: int) -> SyncOutcome:
        """Called after every optimizer step with the trainer's absolute step number."""
        if not self._started:
            raise RuntimeError("DiLoCoNode.start must be called before on_step")
        self._last_step = step
        self._drain()
        due = self.plan.due(step)
        boundary = bool(due)
        dispatched = False
        if boundary:
            self._capture(step)
            for fragment in due:
                dispatched = self._dispatch(step, fragment) or dispatched
        installed = self._install_candidate(step)
        self._schedule(step, boundary)
        return SyncOutcome(dispatched=dispatched, installed=installed)

    # -- progress bookkeeping ----------------------------------------------------------

    def _capture(self, step: int) -> None:
        """Fold ``baseline - current`` into the pending delta; the current weights become
        the baseline. Idempotent within a step."""
        if self._captured_step == step:
            return
        assert self.baseline is not None  # set by start()
        current = _snapshot(self.model, self.layout.sync_keys)
        segment = pseudo_gradient(self.baseline, current, self.layout.sync_keys)
        work = self._take_work(step)
        if self._skip is not None:
            segment, work = self._drop_sent(segment, work, step)
        self._add_pending(segment, self.installed_step, work)
        self.baseline = current
        self._baseline_step = step
        self._captured_step = step

    def _drop_sent(
        self, segment: dict[str, torch.Tensor], work: tuple[int, int], step: int
    ) -> tuple[dict[str, torch.Tensor], tuple[int, int]]:
        """The part of ``segment`` (the progress since the baseline, to ``step``) that an
        earlier life of this node has not sent: a fragment's progress trained from a
        baseline before the step it was sent through is dropped (those samples are on the
        hub already) and its range restarts here; so are the segment's tokens and samples
        when it began before the step they were reported through. Skipping ends once
        every such step is passed."""
        assert self._skip is not None and self._range_starts is not None
        start = self._baseline_step
        for fragment, through in self._skip.items():
            if start < through:
                for key in self.plan.fragments[fragment]:
                    segment[key] = torch.zeros_like(segment[key])
                self._range_starts[fragment] = step
        if start < self._skip_work:
            work = (0, 0)
        if step >= max(self._skip_work, *self._skip.values()):
            self._skip = None
        return segment, work

    def _add_pending(
        self, delta: Mapping[str, torch.Tensor], base: int, work: tuple[int, int] = (0, 0)
    ) -> None:
        """Add ``delta`` (made from global ``base`` by training ``work`` tokens and
        samples; a fragment's residual may hold only some keys) to the pending delta,
        which always holds every key. Out of place: a checkpoint taken earlier may still
        hold the previous tensors."""
        if self.pending is None:
            self.pending = {
                key: delta[key] if key in delta else self._zeros(key)
                for key in self.layout.sync_keys
            }
            self.pending_base = base
            self.pending_work = work
        else:
            self.pending = {
                key: value + delta[key] if key in delta else value
                for key, value in self.pending.items()
            }
            self.pending_base = min(self.pending_base, base)
            self.pending_work = (self.pending_work[0] + work[0], self.pending_work[1] + work[1])

    def record_work(self, tokens: int, samples: int) -> None:
        """The trainer's token and sample counters now (called before ``on_step``); what
        they grew by since the last capture travels with the delta (``weight_by_work``)."""
        self._work_now = (tokens, samples)

    def _take_work(self, step: int) -> tuple[int, int]:
        """The tokens and samples trained since the last capture; a master also tells its
        loop what one of its steps trains (the default cap of a delta's claimed work)."""
        now, mark = self._work_now, self._work_mark
        self._work_mark = now
        work = (max(0, now[0] - mark[0]), max(0, now[1] - mark[1]))
        steps = 0 if self._work_step is None else step - self._work_step
        self._work_step = step
        if self.master is not None and steps > 0:
            self.master.observe_step_work(-(-work[0] // steps), -(-work[1] // steps))
        return work

    def _drop_pending(self, step: int) -> None:
        """Forget the pending delta (its work too); every fragment's range restarts here."""
        self.pending = None
        self.pending_work = (0, 0)
        self._range_starts = [step] * self.plan.count

    def _zeros(self, key: str) -> torch.Tensor:
        return torch.zeros(self.layout.wire_shapes[key], dtype=torch.float32)

    def _take_fragment(self, fragment: int) -> tuple[dict[str, torch.Tensor], str] | None:
        """The pending delta's keys of ``fragment`` (``None`` when they are all zero);
        they are removed from the pending delta (zeroed; all of it with one fragment)."""
        pending = self.pending
        assert pending is not None
        if self.plan.count == 1:
            if _all_zero(pending):
                return None
            self.pending = None
            return pending, ""
        keys = self.plan.fragments[fragment]
        part = {key: pending[key] for key in keys}
        if _all_zero(part):
            return None
        self.pending = {
            key: self._zeros(key) if key in part else value for key, value in pending.items()
        }
        return part, self.plan.name(fragment)

    def _dispatch(self, step: int, fragment: int = 0) -> bool:
        """Hand the unconfirmed job (a resend, whatever its fragment) or ``fragment``'s
        share of the pending delta to the upload lane."""
        if self.installed_step < 0 or self._resync or not self._startup_done:
            return False  # no global yet, or start-up reconciliation still open
        if self.upload_lane.busy:
            self.stats.boundaries_skipped += 1
            self._publish("delta_upload_skipped", {"step": step, "reason": "upload_in_flight"})
            return False  # the next boundary sends a cumulative delta
        job = self.unconfirmed
        if job is None:
            pending = self.pending
            if pending is None:
                return False
            if not _all_finite(pending):
                logger.error(
                    "diloco node %s: local weights are NaN/Inf at step %d; this delta is "
                    "dropped and the node resynchronises from the next global",
                    self.settings.node_id,
                    step,
                )
                self._drop_pending(step)
                self._resync = True
                self.stats.resyncs += 1
                return False
            base, work = self.pending_base, self.pending_work
            taken = self._take_fragment(fragment)
            if taken is None:
                return False
            if self.pending is not None:  # a fragment: the work so far travels with it
                self.pending_work = (0, 0)
            assert self._range_starts is not None  # set by start()
            job = UploadJob(taken[0], step, base, *work, taken[1], self._range_starts[fragment])
            self._range_starts[fragment] = step
            self._dispatched_through = max(self._dispatched_through, step)
            self.unconfirmed = job
        submitted = self.upload_lane.try_submit(lambda: self._upload(job))
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
        candidate = self._candidate
        self._candidate = None
        if candidate is None or candidate.outer_step <= self.installed_step:
            return None
        if self._resync:
            # Our unsent progress is NaN/Inf: drop it.
            self._drop_pending(step)
            self._resync = False
        else:
            self._capture(step)  # keep progress not yet sent: it goes out at the next boundary
            if self.installed_step < 0 and not self._started_from(candidate):
                # First global, and it is not the weights this node started from (another
                # seed): progress measured from those weights means nothing to the hub.
                self._drop_pending(step)
        state = dict(candidate.state)
        if self.pending is not None:
            # The delta-carry rule: the weights become the global plus the progress the hub
            # does not have yet, and that progress now stands on this global (its base).
            # Installing the bare global instead would throw the node's unsent work out of
            # its weights, to come back only at outer_lr x staleness weight a round later.
            state.update(carry(candidate.state, self.pending))
            self.pending_base = candidate.outer_step
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
            if self.pending is not None:
                origin = origin + self.pending[key]
            target = candidate.state[key].to(torch.float32)
            if not torch.allclose(origin, target, rtol=1e-5, atol=1e-6):
                return False
        return True

    # -- background jobs (run on lanes; never touch the model) --------------------------

    def _upload(self, job: UploadJob) -> None:
        started = self._clock()
        info = DeltaInfo(
            node_id=self.settings.node_id,
            local_step=job.local_step,
            base_outer_step=job.base_outer_step,
            incarnation=self.incarnation,
            tokens=job.tokens,
            samples=job.samples,
            fragment=job.fragment,
            first_step=job.first_step,
        )
        residual = None
        try:
            encoding = self.settings.encoding
            layout = fragment_layout(self.layout, job.fragment)  # the fragment's keys only
            wire = to_wire(job.delta, layout, encoding)
            if encoding.lossy and self.settings.error_feedback:
                sent = from_wire(wire, layout, encoding)
                residual = {key: job.delta[key] - sent[key] for key in sent}
            data = encode_wire(
                wire, info, self.layout, secret=self.settings.secret, encoding=encoding
            )
            path = delta_path(info.node_id, info.local_step, parse_header(data).metadata["sha256"])
            self.transport.put(path, data)
        except TransportError as exc:
            self.reporter.failure("upload", exc, permanent=not exc.transient)
            self._uploads.put(UploadResult(job, None, 0, self._clock() - started, str(exc)))
            return
        self.reporter.success("upload")
        latency = self._clock() - started
        self._uploads.put(UploadResult(job, path, len(data), latency, None, residual))

    def _poll(
        self, installed_step: int, seen_step: int, fetch: bool, checkpoint_step: int | None
    ) -> None:
        started = self._clock()
        try:
            pointer = self._read_pointer()
            if pointer is not None and pointer.outer_step < seen_step:
                self._reject_replay(pointer.outer_step, seen_step)
                pointer = None
            sent = None
            if checkpoint_step is not None:
                sent = self._sent_after(checkpoint_step, pointer)
            candidate = None
            if fetch and pointer is not None and pointer.outer_step > installed_step:
                candidate = self._fetch_global(pointer)
        except TransportError as exc:
            self.reporter.failure("poll", exc, permanent=not exc.transient)
            self._polls.put(PollResult(ok=False))
            return
        except Rejected as exc:
            self.reporter.failure("poll", exc, permanent=True)
            self._polls.put(PollResult(ok=False))
            return
        self.reporter.success("poll")
        self._polls.put(
            PollResult(
                ok=True,
                pointer_step=None if pointer is None else pointer.outer_step,
                candidate=candidate,
                sent=sent,
                latency_s=self._clock() - started,
                progress=None if pointer is None else pointer.progress.get(self.settings.node_id),
            )
        )

    def _reject_replay(self, pointer_step: int, seen_step: int) -> None:
        """A pointer older than one this node has seen (a replayed or rolled-back file) is
        never followed; logged once per pair of steps."""
        if (pointer_step, seen_step) in self._replays_logged:
            return
        self._replays_logged.add((pointer_step, seen_step))
        logger.warning(
            "diloco node %s rejected the hub pointer at outer step %d: it has seen outer step "
            "%d (a replayed or rolled-back pointer); waiting for a newer one",
            self.settings.node_id,
            pointer_step,
            seen_step,
        )

    def _read_pointer(self) -> Pointer | None:
        raw = self.transport.get(POINTER_PATH)
        if raw is None:
            return None
        return decode_pointer(raw, fingerprint=self.layout.fingerprint, secret=self.settings.secret)

    def _fetch_global(self, pointer: Pointer) -> GlobalCandidate | None:
        data = self.transport.get(pointer.model_file)
        if data is None:
            return None  # pruned between reading the pointer and the file: next poll
        state = decode_global(
            data,
            self.layout,
            secret=self.settings.secret,
            outer_step=pointer.outer_step,
            expected_sha256=pointer.model_sha256,
        )
        return GlobalCandidate(pointer.outer_step, state)

    def _sent_after(self, checkpoint_step: int, pointer: Pointer | None) -> dict[str, int]:
        """What this node incarnation sent of work made after ``checkpoint_step``: per
        fragment field, the highest local step applied (the pointer's ``covered``; its
        ``progress`` as ``"*"``, any fragment, from a master of an earlier version) or
        still waiting under ``nodes/<id>/`` (this incarnation's files, by their signed
        headers). Empty when nothing was sent after the checkpoint."""
        node, incarnation = self.settings.node_id, self.incarnation
        sent: dict[str, int] = {}

        def note(fragment: str, step: int) -> None:
            if step > checkpoint_step:
                sent[fragment] = max(sent.get(fragment, -1), step)

        if pointer is not None:
            covered = pointer.covered.get(node, {}).get(incarnation)
            progress = pointer.progress.get(node)
            if covered is not None:
                for fragment, step in covered.items():
                    note(fragment, step)
            elif progress is not None and progress[0] == incarnation:
                note("*", progress[1])
        for item in self.transport.list_files(f"nodes/{node}"):
            name = parse_delta_path(item.path)
            if name is None or name.local_step <= checkpoint_step:
                continue
            fragment_field = self._own_delta_fragment(item.path)
            if fragment_field is not None:
                note(fragment_field, name.local_step)
        return sent

    def _own_delta_fragment(self, path: str) -> str | None:
        """The fragment field of a delta file under this node's folder when its signed
        header says this node incarnation made it; ``None`` for anything else (another
        incarnation's file, an unreadable or forged one)."""
        try:
            data = self.transport.get(path)
            if data is None:
                return None
            metadata = parse_header(data).metadata
            check_signature(metadata, self.settings.secret, "delta")
            fields = metadata_fields(metadata, "delta", ("node_id", "incarnation"))
        except (Rejected, UnreadableFileError):
            return None
        if (fields.text("node_id"), fields.text("incarnation")) != (
            self.settings.node_id,
            self.incarnation,
        ):
            return None
        return fields.text("fragment", "")

    def _master_reconcile(self, initial: dict[str, torch.Tensor]) -> None:
        assert self.master is not None
        try:
            state = self.master.reconcile(initial)
        except TransportError as exc:
            self.reporter.failure("master start", exc, permanent=not exc.transient)
            return
        except Rejected as exc:
            self.reporter.failure("master start", exc, permanent=True)
            return
        self.reporter.success("master start")
        self._rounds.put(MasterEvent(GlobalCandidate(state.outer_step, state.global_state), None))

    def _master_round(self) -> None:
        assert self.master is not None
        try:
            report = self.master.sync_once()
        except MasterConflictError as exc:
            self.reporter.failure("master round", exc, permanent=True)
            return
        except TransportError as exc:
            self.reporter.failure("master round", exc, permanent=not exc.transient)
            return
        self.reporter.success("master round")
        candidate = None
        if report.published:
            snapshot = self.master.snapshot()
            if snapshot is not None:
                candidate = GlobalCandidate(snapshot.outer_step, snapshot.global_state)
        self._rounds.put(MasterEvent(candidate, report))

    # -- training-thread side of the lanes ---------------------------------------------

    def _drain(self) -> None:
        for result in self._uploads.drain():
            if result.error is None:
                if self.unconfirmed is result.job:
                    self.unconfirmed = None
                if result.residual is not None:
                    self._add_pending(result.residual, result.job.base_outer_step)
                self.stats.uploads += 1
                self.stats.sync_latency_s = result.latency_s
                self._publish("delta_uploaded", {"step": result.job.local_step})
            else:
                self.stats.upload_failures += 1  # the same job is re-sent at the next boundary
                self._publish(
                    "delta_upload_failed", {"step": result.job.local_step, "error": result.error}
                )
        for poll in self._polls.drain():
            if not poll.ok:
                continue
            if poll.pointer_step is not None:
                self.stats.hub_outer_step = max(self.stats.hub_outer_step, poll.pointer_step)
            if poll.sent is not None and not self._startup_done:
                self._finish_startup(poll.sent)
            if poll.progress is not None and self._startup_done:
                self._check_own_progress(*poll.progress)
            self._offer(poll.candidate)
        for event in self._rounds.drain():
            self._offer(event.candidate)
            if event.report is None:
                self._last_round = -pymath.inf  # reconciled: the first round may run now
            else:
                self._record_round(event.report)

    def _offer(self, candidate: GlobalCandidate | None) -> None:
        if candidate is None:
            return
        self.stats.hub_outer_step = max(self.stats.hub_outer_step, candidate.outer_step)
        if self._candidate is None or candidate.outer_step > self._candidate.outer_step:
            self._candidate = candidate

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
        progress up to what was sent, is dropped per fragment (``_skip``, ``_drop_sent``)."""
        held, self._held_pending = self._held_pending, None
        skip = self._skip_plan(sent)
        if not skip:
            if held is not None:
                self._add_pending(held, self._held_base, self._held_work)
            self._startup_done = True
            return
        through = max(sent.values())
        logger.info(
            "diloco node %s: the hub already has this node's work up to local step %d "
            "(after its checkpoint at step %s); that work and its recomputation are not "
            "sent again",
            self.settings.node_id,
            through,
            self._checkpoint_step,
        )
        merged = _merge_held(held, self.pending)
        pending = None if merged is None else dict(merged)  # a checkpoint may share the old
        assert self._range_starts is not None  # set by start()
        for fragment in skip:
            if pending is not None:
                for key in self.plan.fragments[fragment]:
                    pending[key] = torch.zeros_like(pending[key])
            self._range_starts[fragment] = self._last_step
        bases = [
            base
            for base, part in ((self._held_base, held), (self.pending_base, self.pending))
            if part is not None
        ]
        self.pending = None if pending is None or _all_zero(pending) else pending
        self.pending_base = min(bases, default=self.pending_base)
        self.pending_work = (0, 0)  # reported with what was sent
        self._skip, self._skip_work = skip, through
        self._dispatched_through = max(self._dispatched_through, through)
        self.stats.resyncs += 1
        self._startup_done = True

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
        if incarnation != self.incarnation or step <= self._dispatched_through:
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
                self._dispatched_through,
                self.settings.node_id,
            )
            self._foreign_logged = True
        self.incarnation = uuid.uuid4().hex[:12]

    def _schedule(self, step: int, boundary: bool) -> None:
        now = self._clock()
        master = self.master
        if master is not None and self.acts_as_master and not self.master_lane.busy:
            if now - self._last_round >= self.settings.poll_interval:
                self._last_round = now
                if master.reconciled:
                    self.master_lane.try_submit(self._master_round)
                else:
                    initial = global_tensors(self.model.state_dict(), self.layout)
                    snapshot = {k: v.detach().to("cpu", copy=True) for k, v in initial.items()}
                    self.master_lane.try_submit(lambda: self._master_reconcile(snapshot))
        fetch = not self.acts_as_master
        if not fetch and self._startup_done:
            return  # a master gets its globals in-process
        if self.poll_lane.busy or not (
            boundary or now - self._last_poll >= self.settings.poll_interval
        ):
            return
        self._last_poll = now
        installed = self.installed_step
        seen = max(installed, self.stats.hub_outer_step)
        checkpoint_step = None if self._startup_done else self._checkpoint_step
        self.poll_lane.try_submit(lambda: self._poll(installed, seen, fetch, checkpoint_step))

    # -- checkpoint state ---------------------------------------------------------------

    def state_dict(self) -> dict[str, object]:
        """Everything needed to resume (tensors, numbers, strings, lists, dicts, None)."""
        job = self.unconfirmed
        return {
            "format": STATE_FORMAT,
            "node_id": self.settings.node_id,
            "role": self.settings.role,
            "incarnation": self.incarnation,
            "installed_outer_step": self.installed_step,
            "checkpoint_step": self._last_step,
            "baseline": self.baseline,
            "pending": self.pending,
            "pending_base": self.pending_base,
            "held_pending": self._held_pending,
            "held_base": self._held_base,
            "pending_work": list(self.pending_work) if self.pending is not None else [0, 0],
            "held_work": list(self._held_work),
            "work_mark": list(self._work_mark),
            "range_starts": list(self._range_starts or []),
            "dispatched_through": self._dispatched_through,
            "unconfirmed": None
            if job is None
            else {
                "delta": job.delta,
                "local_step": job.local_step,
                "base_outer_step": job.base_outer_step,
                "tokens": job.tokens,
                "samples": job.samples,
                "fragment": job.fragment,
                "first_step": job.first_step,
            },
            "master": {} if self.master is None else self.master.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore a checkpoint (before ``start``). Unsent pending work is held until the
        hub confirms it was not sent after the checkpoint; an unconfirmed upload is re-sent
        as is (the master dedupes it by content hash if it had arrived)."""
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
        self.incarnation = _text(state, "incarnation")
        self.installed_step = _integer(state, "installed_outer_step")
        self.baseline = _optional_tensors(state, "baseline", self.layout)
        self.pending = None
        self._held_pending = _merge_held(
            _optional_tensors(state, "pending", self.layout),
            _optional_tensors(state, "held_pending", self.layout),
        )
        bases = [
            _integer(state, base)
            for base, tensors in (("pending_base", "pending"), ("held_base", "held_pending"))
            if state.get(tensors) is not None
        ]
        self._held_base = min(bases, default=-1)
        pending_work, held_work = _work(state, "pending_work"), _work(state, "held_work")
        self._held_work = (pending_work[0] + held_work[0], pending_work[1] + held_work[1])
        self._work_mark = self._work_now = _work(state, "work_mark")
        unconfirmed = state.get("unconfirmed")
        if isinstance(unconfirmed, Mapping):
            fragment = unconfirmed.get("fragment", "")
            if not isinstance(fragment, str):
                raise ValueError("diloco state: 'unconfirmed.fragment' must be a string")
            try:
                keys = tuple(fragment_shapes(self.layout, fragment))
            except Rejected as exc:
                raise ValueError(f"diloco state: 'unconfirmed': {exc.detail}") from None
            delta = _optional_tensors(unconfirmed, "delta", self.layout, keys)
            if delta is not None:
                first = unconfirmed.get("first_step")
                self.unconfirmed = UploadJob(
                    delta,
                    _integer(unconfirmed, "local_step"),
                    _integer(unconfirmed, "base_outer_step"),
                    *_work(unconfirmed, "tokens", "samples"),
                    fragment,
                    None if first is None else _integer(unconfirmed, "first_step"),
                )
        checkpoint_step = self._checkpoint_step = _integer(state, "checkpoint_step")
        # Checkpoints of earlier versions do not record these: every range then starts at
        # the checkpoint, and what the hub has of this node up to it is this node's.
        self._range_starts = _steps(state, "range_starts", self.plan.count, checkpoint_step)
        through = state.get("dispatched_through", checkpoint_step)
        self._dispatched_through = _integer({"dispatched_through": through}, "dispatched_through")
        self._baseline_step = checkpoint_step  # the baseline is from this step or before
        self._work_step = None  # the work mark's step is not recorded: measure afresh
        self._skip = None
        self._startup_done = False
        self._captured_step = None

    # -- metrics ------------------------------------------------------------------------

    def metrics(self) -> dict[str, int | float]:
        """Cumulative counters plus the last round's figures (``diloco/`` keys)."""
        stats = self.stats
        values: dict[str, int | float] = {
            "diloco/outer_step": self.installed_step,
            "diloco/hub_outer_step": stats.hub_outer_step,
            "diloco/uploads": stats.uploads,
            "diloco/upload_failures": stats.upload_failures,
            "diloco/boundaries_skipped": stats.boundaries_skipped,
            "diloco/installs": stats.installs,
            "diloco/resyncs": stats.resyncs,
            "diloco/bytes_up": self.transport.bytes_up,
            "diloco/bytes_down": self.transport.bytes_down,
            "diloco/sync_latency_s": stats.sync_latency_s,
            "diloco/errors": self.reporter.errors,
        }
        if self.master is not None:
            values["diloco/rounds"] = stats.rounds
            values["diloco/deltas_found"] = stats.deltas_found
            values["diloco/deltas_included"] = stats.deltas_included
            values["diloco/deltas_rejected"] = stats.deltas_rejected
            values["diloco/deltas_duplicate"] = stats.deltas_duplicate
            last = stats.last_round
            if last is not None:
                staleness = last.staleness
                values["diloco/round_included"] = last.included
                values["diloco/round_latency_s"] = last.latency_s
                values["diloco/staleness_mean"] = (
                    sum(staleness) / len(staleness) if staleness else 0.0
                )
                values["diloco/staleness_max"] = max(staleness, default=0)
        return values


def _text(state: Mapping[str, object], key: str) -> str:
    value = state.get(key)
    if not isinstance(value, str):
        raise ValueError(f"diloco state: {key!r} must be a string")
    return value


def _integer(state: Mapping[str, object], key: str) -> int:
    value = state.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"diloco state: {key!r} must be an integer")
    return value


def _steps(state: Mapping[str, object], key: str, count: int, default: int) -> list[int]:
    """``count`` step numbers under ``key`` (``default`` each when absent or when the
    checkpoint was taken with another number of fragments)."""
    value = state.get(key)
    if value is None:
        return [default] * count
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(item, int) and not isinstance(item, bool) for item in value
    ):
        raise ValueError(f"diloco state: {key!r} must be a list of step numbers")
    return [int(item) for item in value] if len(value) == count else [default] * count


def _work(state: Mapping[str, object], *keys: str) -> tuple[int, int]:
    """Tokens and samples: ``[tokens, samples]`` under one key, or one key each; (0, 0)
    when absent (a checkpoint of an earlier version)."""
    if len(keys) == 1:
        value = state.get(keys[0], [0, 0])
        if not (isinstance(value, (list, tuple)) and len(value) == 2):
            raise ValueError(f"diloco state: {keys[0]!r} must be [tokens, samples]")
        items = list(value)
    else:
        items = [state.get(key, 0) for key in keys]
    if not all(isinstance(item, int) and not isinstance(item, bool) for item in items):
        raise ValueError(f"diloco state: {keys} must be integers")
    return (int(items[0]), int(items[1]))


def _optional_tensors(
    state: Mapping[str, object],
    key: str,
    layout: ModelLayout,
    keys: tuple[str, ...] | None = None,
) -> dict[str, torch.Tensor] | None:
    """``state[key]``: tensors of exactly ``keys`` (default: every synchronised key)."""
    value = state.get(key)
    if value is None:
        return None
    expected = set(layout.sync_keys if keys is None else keys)
    if not isinstance(value, Mapping) or set(value) != expected:
        raise ValueError(f"diloco state: {key!r} does not match this model's layout")
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in value.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"diloco state: {key!r}[{name!r}] is not a tensor")
        tensors[str(name)] = tensor.detach().to("cpu")
    return tensors


def _merge_held(
    first: dict[str, torch.Tensor] | None, second: dict[str, torch.Tensor] | None
) -> dict[str, torch.Tensor] | None:
    if first is None:
        return second
    if second is None:
        return first
    return {key: first[key].to(torch.float32) + second[key].to(torch.float32) for key in first}
