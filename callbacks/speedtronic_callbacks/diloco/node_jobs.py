"""The background jobs of a DiLoCo node (``node``) and the lanes they run on: upload a
delta, poll the hub pointer and fetch a newer global, read what this node sent before a
resume, and -- on the master's node -- reconcile and run master rounds. They never touch
the model; they report through the inboxes (``uploads``, ``polls``, ``rounds``) that the
training thread drains."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from speedtronic_callbacks.diloco.hub_files import delta_path, parse_delta_path
from speedtronic_callbacks.diloco.lanes import ErrorReporter, Inbox, Lane
from speedtronic_callbacks.diloco.master import MasterConflictError, MasterLoop
from speedtronic_callbacks.diloco.model_layout import ModelLayout
from speedtronic_callbacks.diloco.node_messages import (
    GlobalCandidate,
    MasterEvent,
    PollResult,
    UploadJob,
    UploadResult,
)
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
    fragment_layout,
    from_wire,
    metadata_fields,
    parse_header,
    to_wire,
)

if TYPE_CHECKING:
    from speedtronic_callbacks.diloco.node import NodeSettings

logger = logging.getLogger("speedtronic.diloco")


class NodeJobs:
    """A node's three lanes (upload, poll, master) and the jobs it hands them. The
    training thread submits (``submit_*``; ``False``: the lane is busy) and drains the
    inboxes; the jobs run on the lanes' threads and read only what is passed to them,
    the transport, and ``incarnation`` (which the training thread may renew)."""

    def __init__(
        self,
        transport: RetryingTransport,
        layout: ModelLayout,
        settings: NodeSettings,
        master: MasterLoop | None,
        reporter: ErrorReporter,
        clock: Callable[[], float],
    ) -> None:
        self.transport = transport
        self.layout = layout
        self.settings = settings
        self.master = master
        self.reporter = reporter
        self._clock = clock
        self.incarnation = uuid.uuid4().hex[:12]
        """This node life's name on the hub (signed into every delta it sends)."""
        self.upload_lane = Lane("upload")
        self.poll_lane = Lane("poll")
        self.master_lane = Lane("master")
        self.uploads: Inbox[UploadResult] = Inbox()
        self.polls: Inbox[PollResult] = Inbox()
        self.rounds: Inbox[MasterEvent] = Inbox()
        self._replays_logged: set[tuple[int, int]] = set()

    # -- the training thread's side ----------------------------------------------------

    def open(self) -> None:
        self.transport.cancel.clear()
        for lane in (self.upload_lane, self.poll_lane, self.master_lane):
            lane.open()

    def close(self, timeout: float) -> bool:
        """Give the upload in flight ``timeout`` s to finish, then cancel every retry wait
        and stop the lanes; whether the master lane ended idle."""
        self.upload_lane.close(timeout)
        self.transport.cancel.set()
        master_idle = self.master_lane.close(timeout)
        self.poll_lane.close(timeout)
        return master_idle

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all(
            lane.wait_idle(max(0.0, deadline - time.monotonic()))
            for lane in (self.upload_lane, self.poll_lane, self.master_lane)
        )

    def submit_upload(self, job: UploadJob) -> bool:
        return self.upload_lane.try_submit(lambda: self._upload(job))

    def submit_poll(
        self, installed_step: int, seen_step: int, fetch: bool, checkpoint_step: int | None
    ) -> bool:
        return self.poll_lane.try_submit(
            lambda: self._poll(installed_step, seen_step, fetch, checkpoint_step)
        )

    def submit_round(self) -> bool:
        return self.master_lane.try_submit(self._master_round)

    def submit_reconcile(self, initial: dict[str, torch.Tensor]) -> bool:
        return self.master_lane.try_submit(lambda: self._master_reconcile(initial))

    # -- the jobs (on the lanes' threads) ----------------------------------------------

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
            self.uploads.put(UploadResult(job, None, 0, self._clock() - started, str(exc)))
            return
        self.reporter.success("upload")
        latency = self._clock() - started
        self.uploads.put(UploadResult(job, path, len(data), latency, None, residual))

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
            self.polls.put(PollResult(ok=False))
            return
        except Rejected as exc:
            self.reporter.failure("poll", exc, permanent=True)
            self.polls.put(PollResult(ok=False))
            return
        self.reporter.success("poll")
        self.polls.put(
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
        self.rounds.put(MasterEvent(GlobalCandidate(state.outer_step, state.global_state), None))

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
        self.rounds.put(MasterEvent(candidate, report))
