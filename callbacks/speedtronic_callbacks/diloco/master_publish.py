"""How a master publishes and guards the hub pointer (``master``, steps 0 and 4): the
pointer check before and after a round (pause on an unreadable pointer, republish over a
replayed one, halt when another master moved it), the publication of model, outer state
and pointer (the pointer last), the deletion of applied deltas and old versions, and the
audit log."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from datetime import datetime, timezone
from pathlib import Path

from speedtronic.state.append_io import open_to_append
from speedtronic_callbacks.diloco.hub_files import (
    OuterState,
)
from speedtronic_callbacks.diloco.hub_gc import delete_applied, stale_globals
from speedtronic_callbacks.diloco.master_report import (
    MasterConflictError,
    MasterSettings,
    RoundReport,
)
from speedtronic_callbacks.diloco.model_layout import ModelLayout
from speedtronic_callbacks.diloco.pointer import (
    POINTER_PATH,
    Pointer,
    decode_pointer,
    encode_pointer,
    model_file_name,
    outer_file_name,
)
from speedtronic_callbacks.diloco.recovery import HubVersions
from speedtronic_callbacks.diloco.transport_base import (
    Replaced,
    Transport,
    UnreadableFileError,
)
from speedtronic_callbacks.diloco.wire import (
    Rejected,
    encode_global,
    encode_outer,
    parse_header,
)

logger = logging.getLogger("speedtronic.diloco")


class MasterState:
    """The master's committed outer state behind one lock: the round's lane moves it, the
    training thread (checkpoints, metrics) reads it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.current: OuterState | None = None

    @property
    def outer_step(self) -> int:
        with self.lock:
            return -1 if self.current is None else self.current.outer_step

    def snapshot(self) -> OuterState | None:
        """A copy to work on (tensors shared: a round replaces entries, never edits them)."""
        with self.lock:
            if self.current is None:
                return None
            state = self.current
            return OuterState(
                global_state=dict(state.global_state),
                momentum=dict(state.momentum),
                outer_step=state.outer_step,
                ledger=state.ledger.copy(),
            )

    def commit(self, state: OuterState) -> None:
        with self.lock:
            self.current = state


class HubPublication:
    """The publication of a master's rounds, held by ``MasterLoop`` (``publication``): the
    hub pointer it guards (``expected``: the pointer it last saw or wrote; ``halted``: why it
    stopped), the published versions, the deletions and the audit log."""

    def __init__(
        self,
        transport: Transport,
        layout: ModelLayout,
        settings: MasterSettings,
        state: MasterState,
        audit_path: Path | None,
    ) -> None:
        self.transport = transport
        self.layout = layout
        self.settings = settings
        self.state = state
        self.audit_path = audit_path
        self.versions = HubVersions(transport, layout, settings.node_id, settings.secret)
        self.halted: str | None = None
        self.expected: tuple[int, str] | None = None
        self._paused: str | None = None

    def adopt(self, pointer: Pointer) -> OuterState:
        """Load the published global and outer state of ``pointer``."""
        return self.versions.read(pointer.outer_step, pointer.model_sha256, pointer.outer_sha256)

    def check_pointer(self) -> str | None:
        """Compare the hub pointer with what this master last saw or wrote, before a round
        and again before publishing. Returns why the round must pause, or ``None``.

        * unreadable (junk, unsigned, not a regular file, too large): pause -- logged once;
          the next round looks again, and once the pointer is valid the master goes on;
        * missing: halt (the hub was reset; publishing over it could fork the run);
        * older than this master's outer step: a replay or rollback of old files -- rejected,
          logged, and the current state republished (versions only move forward);
        * newer, written under this node id: our own publication that was reported as
          failed but landed -- adopted;
        * anything else: a second master -- halt.
        """
        try:
            raw = self.transport.get(POINTER_PATH)
            pointer = None if raw is None else self._decode_pointer(raw)
        except (Rejected, UnreadableFileError) as exc:
            return self._pause(f"the hub pointer is unusable ({exc})")
        self._resume()
        if pointer is None:
            self._halt("the hub pointer disappeared; refusing to publish over a reset hub")
            return None
        expected = self.expected
        if expected is None or (pointer.outer_step, pointer.master) == expected:
            return None
        current = self.state.outer_step
        if pointer.outer_step < current:
            self._reject_replay(pointer, current)
        elif pointer.master == self.settings.node_id and pointer.outer_step > expected[0]:
            self._adopt_own(pointer)
        else:
            self._halt(
                f"master {pointer.master!r} published outer step {pointer.outer_step} while "
                f"this master ({self.settings.node_id!r}) was at {expected[0]}; only one "
                "master may serve a hub"
            )
        return None

    def _decode_pointer(self, raw: bytes) -> Pointer:
        return decode_pointer(raw, fingerprint=self.layout.fingerprint, secret=self.settings.secret)

    def _pause(self, reason: str) -> str:
        if reason != self._paused:
            logger.warning("diloco master pauses aggregation: %s", reason)
        self._paused = reason
        return reason

    def _resume(self) -> None:
        if self._paused is not None:
            logger.info("diloco master: the hub pointer is valid again; aggregation resumes")
        self._paused = None

    def _reject_replay(self, pointer: Pointer, current: int) -> None:
        """An older pointer than this master's state: never adopt it; put ours back."""
        logger.error(
            "diloco master %s rejected the hub pointer at outer step %d written under %r: "
            "this master is at outer step %d (a replayed or rolled-back file); republishing "
            "outer step %d",
            self.settings.node_id,
            pointer.outer_step,
            pointer.master,
            current,
            current,
        )
        state = self.state.snapshot()
        assert state is not None  # reconciled
        self.expected = (pointer.outer_step, pointer.master)  # knowingly replaced
        self.publish(state, applied=(), deletes=self.stale_globals(state.outer_step))

    def _adopt_own(self, pointer: Pointer) -> None:
        """Our own publication that we counted as failed (a timed-out request that
        completed after all): the hub is the truth."""
        logger.warning(
            "diloco master %s: the hub holds outer step %d written under this node id; adopting it",
            self.settings.node_id,
            pointer.outer_step,
        )
        self.state.commit(self.adopt(pointer))
        self.expected = (pointer.outer_step, pointer.master)

    def _halt(self, reason: str) -> None:
        self.halted = reason
        logger.error("diloco master stops aggregating: %s", reason)
        raise MasterConflictError(reason)

    def publish(
        self,
        state: OuterState,
        applied: tuple[str, ...],
        deletes: list[str] | None = None,
        *,
        judge: bool = True,
    ) -> Pointer:
        """Write model, outer state and -- last -- the pointer (one commit on the Hub),
        removing ``deletes`` (applied deltas, old globals) in the same commit. Elsewhere
        the pointer is swapped in (``Transport.replace``) and, with ``judge``, what it
        replaced is judged (``_judge_replaced``): a junk pointer written during the round
        is reported. Start-up (``reconcile``) replaces what it has just read, knowingly."""
        secret = self.settings.secret
        step = state.outer_step
        model_bytes = encode_global(state.global_state, step, self.layout, secret=secret)
        outer_bytes = encode_outer(state.momentum, state.ledger, step, self.layout, secret=secret)
        pointer = Pointer(
            outer_step=step,
            model_file=model_file_name(step),
            model_sha256=parse_header(model_bytes).metadata["sha256"],
            outer_file=outer_file_name(step),
            outer_sha256=parse_header(outer_bytes).metadata["sha256"],
            fingerprint=self.layout.fingerprint,
            master=self.settings.node_id,
            updated_at=datetime.now(timezone.utc).isoformat(),
            applied=applied,
            progress=dict(state.ledger.progress),
            covered=state.ledger.copy().covered,
        )
        pointer_bytes = encode_pointer(pointer, secret=secret)
        files = [(pointer.model_file, model_bytes), (pointer.outer_file, outer_bytes)]
        removals = sorted(set(deletes or []))
        expected = self.expected
        if self.transport.atomic_commit:
            self.transport.commit([*files, (POINTER_PATH, pointer_bytes)], removals)
            self.expected = (step, self.settings.node_id)
            return pointer
        self.transport.commit(files)
        replaced = self.transport.replace(POINTER_PATH, pointer_bytes)
        self.expected = (step, self.settings.node_id)
        self.transport.commit([], removals)
        if judge:
            self._judge_replaced(replaced, expected, pointer_bytes, step)
        return pointer

    def _judge_replaced(
        self, replaced: Replaced, expected: tuple[int, str] | None, written: bytes, step: int
    ) -> None:
        """Report what a publication wrote over when it was not the pointer this master
        last saw or wrote (``expected``): junk or an unreadable file (a WARNING -- the
        publication replaced it, as the pause of a round would have waited for), an older
        pointer (a replay: the ERROR of ``_reject_replay``), another master's (halt)."""
        if expected is None or not replaced.seen or replaced.data == written:
            return  # nothing expected or known, or a retried swap that had landed: our bytes
        if replaced.data is None:
            what = replaced.unreadable or "was missing"
            logger.warning(
                "diloco master %s published outer step %d over a hub pointer that %s "
                "(written during the round)",
                self.settings.node_id,
                step,
                what,
            )
            return
        try:
            found = self._decode_pointer(replaced.data)
        except Rejected as exc:
            logger.warning(
                "diloco master %s published over an unusable hub pointer written during the "
                "round (%s); the new pointer replaced it",
                self.settings.node_id,
                exc,
            )
            return
        if (found.outer_step, found.master) == expected:
            return
        if found.outer_step < expected[0]:
            logger.error(
                "diloco master %s replaced a hub pointer at outer step %d written under %r "
                "during the round (a replayed or rolled-back file)",
                self.settings.node_id,
                found.outer_step,
                found.master,
            )
            return
        self.halted = (
            f"master {found.master!r} published outer step {found.outer_step} while this "
            f"master ({self.settings.node_id!r}) was publishing over it; only one master may "
            "serve a hub"
        )
        logger.error("diloco master stops aggregating: %s", self.halted)

    def delete(self, paths: list[str]) -> None:
        if self.settings.delete_applied:
            delete_applied(self.transport, paths)

    def stale_globals(self, outer_step: int) -> list[str]:
        """Global files this master no longer keeps (``hub_gc.stale_globals``)."""
        return stale_globals(self.transport, outer_step, self.settings.keep_global_versions)

    def audit(self, report: RoundReport) -> None:
        """Append the round to a local JSON-lines log (who was applied, with what weight)."""
        if self.audit_path is None:
            return
        record = {
            "time": datetime.now(timezone.utc).isoformat(),
            "outer_step": report.outer_step,
            "found": report.found,
            "duplicates": report.duplicates,
            "latency_s": round(report.latency_s, 6),
            "applied": [
                {key: value for key, value in dataclasses.asdict(item).items() if key != "path"}
                for item in report.applied
            ],
            "work_unit": report.work_unit,
            "rejected": [
                {"path": item.path, "reason": item.reason.value, "detail": item.detail}
                for item in report.rejected
            ],
        }
        try:
            self.audit_path.parent.mkdir(parents=True, exist_ok=True)
            with open_to_append(self.audit_path) as handle:  # never through a planted link
                handle.write(json.dumps(record, sort_keys=True) + "\n")
        except OSError as exc:
            logger.warning("diloco master could not write its audit log: %s", exc)
