"""The outer loop: collect deltas from the hub, apply one Nesterov step, publish.

``MasterLoop`` is synchronous and thread-safe; the callback runs it on a background lane.
One round (``sync_once``):

0. read the hub pointer: an unreadable one pauses the round (the next looks again), an
   older one than this master's state is a replay and is overwritten (versions only move
   forward), a newer one from another master halts this one (see ``_check_pointer``);
1. list ``nodes/``; skip files examined before in the same version (a rejected file is
   reported once, not downloaded every round; a known applied one is only removed);
2. download and validate each new candidate: only regular files within the size limit are
   read, then signature, fingerprint, keys, shapes, hash, NaN/Inf, name/header agreement;
   a delta whose content hash is in the ledger is a duplicate (removed), otherwise its
   staleness is checked, and its step range must not reach back into steps already
   applied from its node incarnation (``overlap``). Every failure is a logged rejection:
   the file is quarantined -- it stays on the hub and is not examined again until it
   changes (``DeltaIntake.rejected``, checkpointed) -- and the round goes on without it;
3. judge the deltas' norms per fragment (``OuterRound.judge``: clip, or reject as a
   logged ``outlier`` rejection), cap the work each claims at what its node could have
   trained and screen those figures the same way (``DeltaIntake.work_shares``), weight each
   delta by its staleness times its share of the round's work (``OuterRound.weights``,
   policy ``KeptAverage``), aggregate, and apply the outer Nesterov step to a *copy* of
   the global state (``OuterRound.stepped``);
4. publish model file, outer-state file, then the pointer (last, so readers never follow
   it to a missing file; on the Hub all three are one atomic commit), removing the applied
   deltas and old global versions in the same commit. The pointer is swapped in
   (``Transport.replace``), so the master sees what it wrote over and reports a junk
   pointer written during the round (``_judge_replaced``). Only after the pointer is
   written is the new state committed in memory; a failed publication leaves everything
   as it was and the same deltas are applied (exactly once) by a later round.

Restart: ``reconcile`` treats the published pointer as the source of truth unless this
master's checkpoint is ahead of it. A master resumed from an older checkpoint adopts the
newer published global, momentum and ledger instead of rolling the hub back, so nothing is
applied twice.

``MasterLoop`` runs the round and holds its parts: ``intake``
(``master_intake.DeltaIntake``: steps 1-3's listing, validation, quarantine and work
claims), ``round`` (``outer_round.OuterRound``: the judge, the weights and the outer step,
the component the collective exchange holds too -- the hub's files are the transport, the
weighted mean by key, ``fragments.aggregate_by_key``, the combiner) and ``publication``
(``master_publish.HubPublication``: steps 0 and 4, the pointer and the publication), which
shares the committed ``state`` (``master_publish.MasterState``) with the loop. The
settings and a round's report are ``master_report``.

Apart from these modules: reading the versions a hub offers at
start-up (``recovery``); deleting applied deltas and old versions (``hub_gc``); the hub's
file names and ``OuterState`` (``hub_files``); and the files' codecs (``wire``, ``pointer``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from speedtronic_callbacks.diloco.aggregation import NormHistory
from speedtronic_callbacks.diloco.fields import NODE_ID_PATTERN
from speedtronic_callbacks.diloco.fragments import aggregate_by_key
from speedtronic_callbacks.diloco.hub_files import (
    DELTA_PATH_PATTERN,
    DeltaName,
    OuterState,
    clone_state,
    delta_path,
    parse_delta_path,
)
from speedtronic_callbacks.diloco.legacy_hub import V2Pointer, read_v2_pointer
from speedtronic_callbacks.diloco.master_intake import DeltaIntake
from speedtronic_callbacks.diloco.master_publish import HubPublication, MasterState
from speedtronic_callbacks.diloco.master_report import (
    AppliedDelta,
    DeltaRejection,
    MasterConflictError,
    MasterSettings,
    RoundReport,
)
from speedtronic_callbacks.diloco.math import StateDict
from speedtronic_callbacks.diloco.model_layout import ModelLayout
from speedtronic_callbacks.diloco.outer_round import KeptAverage, OuterRound
from speedtronic_callbacks.diloco.pointer import POINTER_PATH, Pointer, decode_pointer
from speedtronic_callbacks.diloco.transport_base import (
    Transport,
    UnreadableFileError,
)
from speedtronic_callbacks.diloco.wire import (
    Ledger,
    Rejected,
    covered_from_json,
    covered_to_json,
    largest_file_bytes,
    progress_from_json,
    progress_to_json,
)

logger = logging.getLogger("speedtronic.diloco")

__all__ = [
    "DELTA_PATH_PATTERN",
    "NODE_ID_PATTERN",
    "AppliedDelta",
    "DeltaName",
    "DeltaRejection",
    "MasterConflictError",
    "MasterLoop",
    "MasterSettings",
    "OuterState",
    "RoundReport",
    "clone_state",
    "delta_path",
    "parse_delta_path",
]


class MasterLoop:
    """The outer optimizer of one hub. Only one may be active per hub in a process."""

    _active: dict[str, MasterLoop] = {}
    _active_lock = threading.Lock()

    def __init__(
        self,
        transport: Transport,
        layout: ModelLayout,
        settings: MasterSettings,
        *,
        audit_path: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.transport = transport
        self.layout = layout
        self.settings = settings
        self._clock = clock
        self._round_lock = threading.Lock()
        self.state = MasterState()
        """The committed outer state (global, momentum, ledger)."""
        self._reconciled = False
        self.round = OuterRound(
            settings.robust,
            KeptAverage(settings.staleness_power),
            lr=settings.outer_lr,
            momentum=settings.outer_momentum,
        )
        """Judge, weights and outer step (its ``norms``: the outlier history per streaming
        fragment, ``""``: whole-model deltas)."""
        self.intake = DeltaIntake(transport, layout, settings, self.round)
        """Steps 1-3: the deltas a round takes in."""
        self.publication = HubPublication(transport, layout, settings, self.state, audit_path)
        """Steps 0 and 4: the pointer, the publication, the audit log."""
        transport.limit_file_size(settings.max_file_bytes or largest_file_bytes(layout))

    # -- single master per hub (per process) -------------------------------------------

    def claim(self) -> None:
        """Register as the hub's master in this process; a second live loop for the same
        hub (for example a restarted callback whose old loop has not finished) is refused."""
        with MasterLoop._active_lock:
            current = MasterLoop._active.get(self.transport.location)
            if current is not None and current is not self:
                raise MasterConflictError(
                    f"a diloco master loop for {self.transport.location} is already running "
                    "in this process"
                )
            MasterLoop._active[self.transport.location] = self

    def release(self) -> None:
        with MasterLoop._active_lock:
            if MasterLoop._active.get(self.transport.location) is self:
                del MasterLoop._active[self.transport.location]

    # -- state -------------------------------------------------------------------------

    @property
    def reconciled(self) -> bool:
        return self._reconciled

    @property
    def halted(self) -> str | None:
        """Why this master stopped aggregating (another master serves the hub), or ``None``."""
        return self.publication.halted

    @property
    def outer_step(self) -> int:
        return self.state.outer_step

    def snapshot(self) -> OuterState | None:
        """A copy of the committed outer state (``None`` before ``reconcile``)."""
        return self.state.snapshot()

    def state_dict(self) -> dict[str, object]:
        """Checkpoint form (tensors, numbers, strings, lists and dicts only)."""
        snapshot = self.snapshot()
        rejected = self.intake.quarantine()
        if snapshot is None:
            return {}
        return {
            "outer_step": snapshot.outer_step,
            "global_state": snapshot.global_state,
            "momentum": snapshot.momentum,
            "applied": sorted(snapshot.ledger.applied),
            "progress": progress_to_json(snapshot.ledger.progress),
            "covered": covered_to_json(snapshot.ledger.covered),
            "rejected": rejected,
            "norm_history": self.round.history("").to_list(),
            "fragment_norm_history": {
                fragment: history.to_list()
                for fragment, history in sorted(self.round.norms.histories.items())
                if fragment
            },
            "work_history": {
                unit: history.to_list()
                for unit, history in sorted(self.intake.works.histories.items())
            },
            "step_work": list(self.intake.step_work),
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Stage a checkpointed state; ``reconcile`` later compares it with the hub."""
        if not state:
            return
        global_state = _tensor_map(state.get("global_state"), "global_state")
        momentum = _tensor_map(state.get("momentum"), "momentum")
        outer_step = state.get("outer_step")
        applied = state.get("applied", [])
        progress = state.get("progress", {})
        covered = state.get("covered", {})
        rejected = state.get("rejected", {})
        if not isinstance(outer_step, int) or not isinstance(applied, list):
            raise ValueError("diloco master state: bad outer_step or applied list")
        try:
            ledger = Ledger(
                applied={str(h) for h in applied},
                progress=progress_from_json(_plain(progress)),
                covered=covered_from_json(_plain(covered)),
            )
        except ValueError as exc:
            raise ValueError(f"diloco master state: {exc}") from None
        window = self.settings.robust.window
        norms = {"": NormHistory.from_state(window, state.get("norm_history"))}
        per_fragment = state.get("fragment_norm_history", {})
        works = state.get("work_history", {})
        if not isinstance(per_fragment, Mapping) or not isinstance(works, Mapping):
            raise ValueError("diloco master state: the norm and work histories must be mappings")
        for fragment, value in per_fragment.items():
            norms[str(fragment)] = NormHistory.from_state(window, value)
        step_work = state.get("step_work", [0, 0])
        if not (
            isinstance(step_work, (list, tuple))
            and len(step_work) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in step_work)
        ):
            raise ValueError("diloco master state: 'step_work' must be [tokens, samples]")
        self.intake.restore(
            {str(k): str(v) for k, v in rejected.items()}
            if isinstance(rejected, Mapping)
            else None,
            {str(unit): NormHistory.from_state(window, value) for unit, value in works.items()},
            (int(step_work[0]), int(step_work[1])),
        )
        with self.state.lock:
            self.round.norms.histories = norms
            self.state.current = OuterState(global_state, momentum, outer_step, ledger)
            self._reconciled = False

    def observe_step_work(self, tokens: int, samples: int) -> None:
        """The tokens and samples one optimizer step of this master's own training took
        (``DeltaIntake.observe_step_work``: the default per-step work cap)."""
        self.intake.observe_step_work(tokens, samples)

    # -- start-up ----------------------------------------------------------------------

    def reconcile(self, initial_global: StateDict) -> OuterState:
        """Agree with the hub before the first round; returns the state to install.

        * no pointer on the hub: publish our state (checkpointed, else ``initial_global``
          as outer step 0) -- the bootstrap;
        * the hub is ahead of (or equal to) our checkpoint: adopt the published global,
          momentum and ledger -- never publish an older step over a newer one;
        * our checkpoint is ahead of the hub (a restored or wiped hub): republish it;
        * the hub holds complete files of a newer outer step than its pointer (an old
          pointer put back): adopt the newest valid version and republish it;
        * the hub was written by speedtronic 2.0: continue from its global model and outer
          step (``_continue_v2``).
        """
        with self._round_lock:
            local = self.snapshot()
            self.transport.prepare(create=True)
            raw = self.transport.get(POINTER_PATH)
            if raw is None:
                state = local or OuterState(clone_state(initial_global), {}, 0, Ledger())
                self.publication.publish(state, applied=(), judge=False)
                logger.info(
                    "diloco master %s published outer step %d to %s (bootstrap)",
                    self.settings.node_id,
                    state.outer_step,
                    self.transport.location,
                )
            elif (legacy := read_v2_pointer(raw)) is not None:
                state = self._continue_v2(legacy, local)
            else:
                pointer = decode_pointer(
                    raw, fingerprint=self.layout.fingerprint, secret=self.settings.secret
                )
                if local is not None and local.outer_step > pointer.outer_step:
                    logger.warning(
                        "diloco hub is at outer step %d but this master's checkpoint is at %d; "
                        "republishing the checkpointed global",
                        pointer.outer_step,
                        local.outer_step,
                    )
                    state = local
                    self.publication.publish(state, applied=(), judge=False)
                elif local is not None and local.outer_step == pointer.outer_step:
                    state = local
                    self.publication.expected = (pointer.outer_step, pointer.master)
                else:
                    state = self._adopt_newest(pointer)
            with self.state.lock:
                self.state.current = state
                self._reconciled = True
            return state

    def _continue_v2(self, legacy: V2Pointer, local: OuterState | None) -> OuterState:
        """Take over a hub that speedtronic 2.0 wrote: its global model and outer step
        become this master's (a checkpoint of this master that is further ahead wins), and
        are republished in this version's layout -- the new pointer replaces 2.0's.

        2.0 kept the outer momentum on its master's disk, so momentum restarts at zero (as
        2.0 itself did when a fresh master adopted a hub). 2.0 deltas still on the hub are
        not applied (their names and headers carry no content hash or signature); they are
        counted in the log and left for the operator to delete.
        """
        if local is not None and local.outer_step > legacy.outer_step:
            state = local
        else:
            state = self.publication.versions.read_v2(legacy)
        leftover = self.publication.versions.v2_deltas()
        self.publication.publish(state, applied=(), judge=False)
        logger.warning(
            "diloco master %s continued a speedtronic 2.0 hub at %s from outer step %d "
            "(momentum restarts at zero; %d 2.0 delta file(s) under nodes/ are not applied "
            "and may be deleted; restart 2.0 workers with this version)",
            self.settings.node_id,
            self.transport.location,
            state.outer_step,
            leftover,
        )
        return state

    def _adopt_newest(self, pointer: Pointer) -> OuterState:
        """Adopt ``pointer``'s version, unless the hub holds a newer complete version that
        validates: then the pointer is an old one put back, and the newer version is
        adopted and republished (versions only move forward)."""
        newest = self.publication.versions.newest_complete_step()
        if newest > pointer.outer_step:
            try:
                state = self.publication.versions.read(newest)
            except (Rejected, UnreadableFileError) as exc:
                logger.warning(
                    "diloco master: files of outer step %d are on the hub but unusable (%s)",
                    newest,
                    exc,
                )
            else:
                logger.error(
                    "diloco master %s rejected the hub pointer at outer step %d: the hub holds "
                    "outer step %d (a replayed or rolled-back pointer); republishing %d",
                    self.settings.node_id,
                    pointer.outer_step,
                    newest,
                    newest,
                )
                self.publication.publish(
                    state, applied=(), deletes=self.publication.stale_globals(newest), judge=False
                )
                return state
        state = self.publication.adopt(pointer)
        self.publication.expected = (pointer.outer_step, pointer.master)
        return state

    # -- one round ---------------------------------------------------------------------

    def sync_once(self) -> RoundReport:
        """Run one outer round (see the module docstring)."""
        if not self._reconciled:
            raise RuntimeError("MasterLoop.reconcile must run before sync_once")
        if self.halted is not None:
            raise MasterConflictError(self.halted)
        with self._round_lock:
            started = self._clock()
            paused = self.publication.check_pointer()
            state = self.snapshot()
            assert state is not None  # set by reconcile
            if paused is not None:
                return RoundReport(state.outer_step, published=False, found=0, paused=paused)
            report, new_state, cleanup = self._round(state, started)
            if new_state is None:
                self.publication.delete(cleanup)
                if report.rejected:
                    self.publication.audit(report)
                return report
            paused = self.publication.check_pointer()
            if paused is not None or self.outer_step != state.outer_step:
                # The pointer broke or moved during the round: these deltas wait for the next.
                report = RoundReport(
                    self.outer_step,
                    published=False,
                    found=report.found,
                    rejected=report.rejected,
                    duplicates=report.duplicates,
                    latency_s=self._clock() - started,
                    paused=paused,
                )
                if report.rejected:
                    self.publication.audit(report)
                return report
            removable = cleanup if self.settings.delete_applied else []
            self.publication.publish(
                new_state,
                applied=tuple(item.sha256 for item in report.applied),
                deletes=removable + self.publication.stale_globals(new_state.outer_step),
            )
            with self.state.lock:
                self.state.current = new_state
                for fragment in set(report.norm_fragments):
                    self.round.record(
                        fragment,
                        (
                            norm
                            for norm, where in zip(report.norms, report.norm_fragments, strict=True)
                            if where == fragment
                        ),
                    )
                if report.work_unit:
                    self.intake.works.record(report.work_unit, report.works)
            report = dataclasses.replace(report, published=True, latency_s=self._clock() - started)
            self.publication.audit(report)
            return report

    def _round(
        self, state: OuterState, started: float
    ) -> tuple[RoundReport, OuterState | None, list[str]]:
        cleanup: list[str] = []
        intake = self.intake
        candidates = intake.candidates(cleanup)
        accepted, rejected, duplicates = intake.validate(state, candidates, cleanup)
        accepted = intake.screen(state, accepted, rejected)
        accepted, unit = intake.work_shares(accepted, rejected)
        if not accepted:
            report = RoundReport(
                outer_step=state.outer_step,
                published=False,
                found=len(candidates),
                rejected=tuple(rejected),
                duplicates=duplicates,
                latency_s=self._clock() - started,
            )
            return report, None, cleanup
        weights = self.round.weights([item.contribution for item in accepted])
        # Deltas of streaming fragments hold only their keys: each key is averaged over
        # the deltas that hold it, and the outer step moves only those keys.
        aggregated = aggregate_by_key([item.decoded.tensors for item in accepted], weights)
        new_global, momentum = self.round.stepped(state.global_state, state.momentum, aggregated)

        ledger = state.ledger.copy()
        applied: list[AppliedDelta] = []
        for item, weight in zip(accepted, weights, strict=True):
            ledger.applied.add(item.decoded.sha256)
            ledger.record(item.decoded.info)
            applied.append(item.applied(weight))
            cleanup.append(item.entry.path)
        new_state = OuterState(new_global, momentum, state.outer_step + 1, ledger)
        report = RoundReport(
            outer_step=new_state.outer_step,
            published=False,
            found=len(candidates),
            applied=tuple(applied),
            rejected=tuple(rejected),
            duplicates=duplicates,
            norms=tuple(item.contribution.norm * item.contribution.clip for item in accepted),
            norm_fragments=tuple(item.decoded.info.fragment for item in accepted),
            works=tuple(item.contribution.work for item in accepted),
            work_unit=unit,
        )
        return report, new_state, cleanup


def _plain(value: object) -> object:
    """A checkpointed mapping as a plain dict (what the JSON parsers of ``wire`` take)."""
    return dict(value) if isinstance(value, Mapping) else value


def _tensor_map(value: object, what: str) -> dict[str, torch.Tensor]:
    if not isinstance(value, Mapping):
        raise ValueError(f"diloco master state: {what} must be a mapping")
    result: dict[str, torch.Tensor] = {}
    for key, tensor in value.items():
        if not isinstance(key, str) or not isinstance(tensor, torch.Tensor):
            raise ValueError(f"diloco master state: bad {what} entry {key!r}")
        result[key] = tensor.detach().to("cpu")
    return result
