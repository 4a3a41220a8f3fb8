"""The background jobs of a DiLoCo node (``node``), run on its lanes: upload a delta,
poll the hub pointer and fetch a newer global, read what this node sent before a
resume, and -- on the master's node -- reconcile and run master rounds. They never touch
the model; they report through the lanes' inboxes."""

from __future__ import annotations

import logging

import torch

from speedtronic_callbacks.diloco.hub_files import delta_path, parse_delta_path
from speedtronic_callbacks.diloco.master import MasterConflictError
from speedtronic_callbacks.diloco.node_messages import (
    GlobalCandidate,
    MasterEvent,
    PollResult,
    UploadJob,
    UploadResult,
)
from speedtronic_callbacks.diloco.node_pending import PendingWork
from speedtronic_callbacks.diloco.pointer import POINTER_PATH, Pointer, decode_pointer
from speedtronic_callbacks.diloco.transport_base import (
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

logger = logging.getLogger("speedtronic.diloco")


class BackgroundJobs(PendingWork):
    """The lane jobs of ``DiLoCoNode``."""

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
