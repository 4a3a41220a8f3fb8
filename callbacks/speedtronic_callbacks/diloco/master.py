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
   changes (``_rejected``, checkpointed) -- and the round goes on without it;
3. screen the deltas' norms for outliers (``aggregation.screen``: clip, or reject as a
   logged ``outlier`` rejection), cap the work each claims at what its node could have
   trained and screen those figures the same way (``_work_shares``), weight each delta by
   its staleness times its share of the round's work, aggregate, and apply the outer
   Nesterov step to a *copy* of the global state;
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

Apart from this module: the algorithm of a round -- screening (``aggregation.Screens``),
work shares, the weighted mean (``fragments.aggregate_by_key``) and the outer Nesterov step
(``math``) -- which the collective exchange shares; reading the versions a hub offers at
start-up (``recovery``); deleting applied deltas and old versions (``hub_gc``); the hub's
file names and ``OuterState`` (``hub_files``); and the files' codecs (``wire``, ``pointer``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import torch

from speedtronic.state.append_io import open_to_append
from speedtronic_callbacks.diloco.aggregation import (
    NormHistory,
    RobustSettings,
    Screening,
    Screens,
    state_norm,
    work_cap,
    work_shares,
    work_unit,
)
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
from speedtronic_callbacks.diloco.hub_gc import delete_applied, stale_globals
from speedtronic_callbacks.diloco.legacy_hub import V2Pointer, read_v2_pointer
from speedtronic_callbacks.diloco.math import (
    NesterovOuterOptimizer,
    StateDict,
    staleness_weight,
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
    RemoteFile,
    Replaced,
    Transport,
    TransportError,
    UnreadableFileError,
)
from speedtronic_callbacks.diloco.wire import (
    DecodedDelta,
    DeltaInfo,
    Ledger,
    Rejected,
    RejectionReason,
    covered_from_json,
    covered_to_json,
    decode_delta,
    encode_global,
    encode_outer,
    largest_file_bytes,
    parse_header,
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


@dataclass(frozen=True)
class MasterSettings:
    """Outer-loop knobs (see the callback options for their meaning and defaults)."""

    node_id: str
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    staleness_power: float = 0.5
    max_staleness: int | None = None
    delete_applied: bool = True
    keep_global_versions: int = 2
    secret: bytes | None = field(default=None, repr=False)
    max_file_bytes: int | None = None
    """Largest hub file read; ``None``: derived from the model (``largest_file_bytes``)."""
    robust: RobustSettings = field(default_factory=RobustSettings)
    """The outlier rule (``outlier_policy``, ``outlier_factor``, ``outlier_window``)."""
    weight_by_work: bool = True
    """Weight deltas by the tokens (else samples) they report, times staleness."""
    inner_steps: int | None = None
    """H of the fleet: a delta's claimed work counts at most H steps (``None``: its range)."""
    max_step_tokens: int | None = None
    """The most tokens one optimizer step of a node trains (``None``: the master's own, as
    its node measures it: ``observe_step_work``)."""
    max_step_samples: int | None = None
    """The same in samples."""


@dataclass(frozen=True)
class DeltaRejection:
    path: str
    reason: RejectionReason
    detail: str


@dataclass(frozen=True)
class AppliedDelta:
    path: str
    sha256: str
    node_id: str
    local_step: int
    base_outer_step: int
    staleness: int
    weight: float
    norm: float = 0.0
    clip: float = 1.0
    """The factor an outlier was scaled by (1: applied as it came)."""
    tokens: int = 0
    samples: int = 0
    first_step: int | None = None
    """The start of the delta's step range (``local_step`` is its end)."""
    work: float = 0.0
    """The work figure the weight came from: the claimed tokens (else samples), capped at
    what the node could have trained and screened like a norm (0: not weighted by work)."""


@dataclass
class _Accepted:
    """A delta that passed validation, on its way through one round's screening."""

    entry: RemoteFile
    decoded: DecodedDelta
    staleness: int
    norm: float = 0.0
    clip: float = 1.0
    work: float = 0.0
    """The work figure its weight comes from (0: the round is not weighted by work)."""
    share: float = 1.0
    """``work / mean(work)`` of the round (1: not weighted by work)."""


@dataclass(frozen=True)
class RoundReport:
    """What one round did (also the per-round metrics)."""

    outer_step: int
    published: bool
    found: int
    applied: tuple[AppliedDelta, ...] = ()
    rejected: tuple[DeltaRejection, ...] = ()
    duplicates: int = 0
    latency_s: float = 0.0
    paused: str | None = None
    """Why the round did nothing (the hub pointer is unreadable), or ``None``."""
    norms: tuple[float, ...] = ()
    """The applied deltas' norms (clipped ones at the bound): the outlier history."""
    norm_fragments: tuple[str, ...] = ()
    """Per norm, the delta's streaming fragment (``"p/P"``; ``""``: the whole model): each
    fragment has its own outlier history."""
    works: tuple[float, ...] = ()
    """The applied deltas' work figures (``AppliedDelta.work``): the work history."""
    work_unit: str = ""
    """``tokens``, ``samples`` or ``""`` (the round was not weighted by work)."""

    @property
    def included(self) -> int:
        return len(self.applied)

    @property
    def staleness(self) -> tuple[int, ...]:
        return tuple(item.staleness for item in self.applied)


class MasterConflictError(RuntimeError):
    """Another master published to the same hub; this one stops aggregating."""


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
        self.audit_path = audit_path
        self._clock = clock
        self._lock = threading.Lock()
        self._round_lock = threading.Lock()
        self._state: OuterState | None = None
        self._reconciled = False
        self._rejected: dict[str, str] = {}
        self.halted: str | None = None
        self._expected_pointer: tuple[int, str] | None = None
        self._known_applied: dict[str, str] = {}
        self._paused: str | None = None
        self._norms = Screens(settings.robust)
        """Outlier history per streaming fragment (``""``: whole-model deltas)."""
        self._works = Screens(settings.robust)
        """Recent applied work figures per unit (``tokens``, ``samples``)."""
        self._step_work = (0, 0)
        """The most tokens and samples one step of this master's own training took (0:
        not measured yet), the default per-step work cap."""
        self._capped: set[str] = set()
        """Nodes whose claimed work was capped (logged once per node)."""
        self._versions = HubVersions(transport, layout, settings.node_id, settings.secret)
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
    def outer_step(self) -> int:
        with self._lock:
            return -1 if self._state is None else self._state.outer_step

    def snapshot(self) -> OuterState | None:
        with self._lock:
            if self._state is None:
                return None
            state = self._state
            return OuterState(
                global_state=dict(state.global_state),
                momentum=dict(state.momentum),
                outer_step=state.outer_step,
                ledger=state.ledger.copy(),
            )

    def state_dict(self) -> dict[str, object]:
        """Checkpoint form (tensors, numbers, strings, lists and dicts only)."""
        snapshot = self.snapshot()
        with self._lock:
            rejected = dict(self._rejected)
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
            "norm_history": self._norms.history("").to_list(),
            "fragment_norm_history": {
                fragment: history.to_list()
                for fragment, history in sorted(self._norms.histories.items())
                if fragment
            },
            "work_history": {
                unit: history.to_list() for unit, history in sorted(self._works.histories.items())
            },
            "step_work": list(self._step_work),
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
        with self._lock:
            self._works.histories = {
                str(unit): NormHistory.from_state(window, value) for unit, value in works.items()
            }
            self._step_work = (int(step_work[0]), int(step_work[1]))
            self._norms.histories = norms
            self._state = OuterState(global_state, momentum, outer_step, ledger)
            self._reconciled = False
            if isinstance(rejected, Mapping):
                self._rejected = {str(k): str(v) for k, v in rejected.items()}

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
                self._publish(state, applied=(), judge=False)
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
                    self._publish(state, applied=(), judge=False)
                elif local is not None and local.outer_step == pointer.outer_step:
                    state = local
                    self._expected_pointer = (pointer.outer_step, pointer.master)
                else:
                    state = self._adopt_newest(pointer)
            with self._lock:
                self._state = state
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
            state = self._versions.read_v2(legacy)
        leftover = self._versions.v2_deltas()
        self._publish(state, applied=(), judge=False)
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
        newest = self._versions.newest_complete_step()
        if newest > pointer.outer_step:
            try:
                state = self._versions.read(newest)
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
                self._publish(state, applied=(), deletes=self._stale_globals(newest), judge=False)
                return state
        state = self._adopt(pointer)
        self._expected_pointer = (pointer.outer_step, pointer.master)
        return state

    def _adopt(self, pointer: Pointer) -> OuterState:
        """Load the published global and outer state of ``pointer``."""
        return self._versions.read(pointer.outer_step, pointer.model_sha256, pointer.outer_sha256)

    # -- one round ---------------------------------------------------------------------

    def sync_once(self) -> RoundReport:
        """Run one outer round (see the module docstring)."""
        if not self._reconciled:
            raise RuntimeError("MasterLoop.reconcile must run before sync_once")
        if self.halted is not None:
            raise MasterConflictError(self.halted)
        with self._round_lock:
            started = self._clock()
            paused = self._check_pointer()
            state = self.snapshot()
            assert state is not None  # set by reconcile
            if paused is not None:
                return RoundReport(state.outer_step, published=False, found=0, paused=paused)
            report, new_state, cleanup = self._round(state, started)
            if new_state is None:
                self._delete(cleanup)
                if report.rejected:
                    self._audit(report)
                return report
            paused = self._check_pointer()
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
                    self._audit(report)
                return report
            removable = cleanup if self.settings.delete_applied else []
            self._publish(
                new_state,
                applied=tuple(item.sha256 for item in report.applied),
                deletes=removable + self._stale_globals(new_state.outer_step),
            )
            with self._lock:
                self._state = new_state
                for fragment in set(report.norm_fragments):
                    self._norms.record(
                        fragment,
                        (
                            norm
                            for norm, where in zip(report.norms, report.norm_fragments, strict=True)
                            if where == fragment
                        ),
                    )
                if report.work_unit:
                    self._works.record(report.work_unit, report.works)
            report = dataclasses.replace(report, published=True, latency_s=self._clock() - started)
            self._audit(report)
            return report

    def _round(
        self, state: OuterState, started: float
    ) -> tuple[RoundReport, OuterState | None, list[str]]:
        cleanup: list[str] = []
        candidates = self._candidates(cleanup)
        accepted, rejected, duplicates = self._validate(state, candidates, cleanup)
        accepted = self._screen(state, accepted, rejected)
        accepted, unit = self._work_shares(accepted, rejected)
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
        power = self.settings.staleness_power
        weights = [
            staleness_weight(item.staleness, power) * item.share * item.clip for item in accepted
        ]
        # Deltas of streaming fragments hold only their keys: each key is averaged over
        # the deltas that hold it, and the outer step moves only those keys.
        aggregated = aggregate_by_key([item.decoded.tensors for item in accepted], weights)
        new_global = dict(state.global_state)
        for key in aggregated:
            new_global[key] = state.global_state[key].clone()
        optimizer = NesterovOuterOptimizer(self.settings.outer_lr, self.settings.outer_momentum)
        optimizer.buffers = {key: value.clone() for key, value in state.momentum.items()}
        optimizer.step(new_global, aggregated)

        ledger = state.ledger.copy()
        applied: list[AppliedDelta] = []
        for item, weight in zip(accepted, weights, strict=True):
            info = item.decoded.info
            ledger.applied.add(item.decoded.sha256)
            ledger.record(info)
            applied.append(
                AppliedDelta(
                    path=item.entry.path,
                    sha256=item.decoded.sha256,
                    node_id=info.node_id,
                    local_step=info.local_step,
                    base_outer_step=info.base_outer_step,
                    staleness=item.staleness,
                    weight=weight,
                    norm=item.norm,
                    clip=item.clip,
                    tokens=info.tokens,
                    samples=info.samples,
                    first_step=info.first_step,
                    work=item.work,
                )
            )
            cleanup.append(item.entry.path)
        new_state = OuterState(new_global, optimizer.buffers, state.outer_step + 1, ledger)
        report = RoundReport(
            outer_step=new_state.outer_step,
            published=False,
            found=len(candidates),
            applied=tuple(applied),
            rejected=tuple(rejected),
            duplicates=duplicates,
            norms=tuple(item.norm * item.clip for item in accepted),
            norm_fragments=tuple(item.decoded.info.fragment for item in accepted),
            works=tuple(item.work for item in accepted),
            work_unit=unit,
        )
        return report, new_state, cleanup

    def _candidates(self, cleanup: list[str]) -> list[tuple[RemoteFile, DeltaName]]:
        """The delta files under ``nodes/`` to examine this round, by node and step. An
        applied one seen before joins ``cleanup``; a quarantined one (rejected before and
        unchanged) is skipped. Records of files no longer listed are forgotten, so the
        quarantine list stays as long as the hub's own listing."""
        listed = self.transport.list_files("nodes")
        paths = {entry.path for entry in listed}
        with self._lock:
            self._rejected = {p: v for p, v in self._rejected.items() if p in paths}
            self._known_applied = {p: v for p, v in self._known_applied.items() if p in paths}
        candidates: list[tuple[RemoteFile, DeltaName]] = []
        for entry in listed:
            name = parse_delta_path(entry.path)
            if name is None:
                continue
            if self._known_applied.get(entry.path) == entry.version:
                cleanup.append(entry.path)  # checked before: an applied delta, unchanged
                continue
            if self._rejected.get(entry.path) == entry.version:
                continue  # quarantined: examined before, unchanged, reported once already
            candidates.append((entry, name))
        candidates.sort(key=lambda item: (item[1].node_id, item[1].local_step, item[0].path))
        return candidates

    def _validate(
        self,
        state: OuterState,
        candidates: list[tuple[RemoteFile, DeltaName]],
        cleanup: list[str],
    ) -> tuple[list[_Accepted], list[DeltaRejection], int]:
        """Download and check every candidate: the deltas to aggregate, the rejections and
        the number of duplicates (applied before or twice in this round: ``cleanup``)."""
        accepted: list[_Accepted] = []
        rejected: list[DeltaRejection] = []
        seen: set[str] = set()  # content hashes accepted in this round
        duplicates = 0
        ranges = state.ledger.copy()  # the step ranges applied, and accepted in this round
        for entry, name in candidates:
            try:
                decoded = self._download(entry, name)
                if decoded is None:
                    continue  # removed since listing
                if _is_applied(decoded.sha256, state.ledger.applied):
                    duplicates += 1
                    cleanup.append(entry.path)
                    with self._lock:
                        self._known_applied[entry.path] = entry.version
                    continue
                staleness = self._staleness(decoded, state.outer_step)
                if decoded.sha256 in seen:
                    duplicates += 1
                    cleanup.append(entry.path)
                    continue
                self._check_range(decoded.info, ranges)
            except Rejected as exc:
                rejected.append(self._reject(entry, exc))
                continue
            except TransportError:
                raise  # the hub, not the file: the round fails and is retried
            except Exception as exc:  # a file must never stop aggregation, even through a bug
                logger.debug("diloco master: %s could not be validated", entry.path, exc_info=True)
                detail = f"could not be validated ({type(exc).__name__}: {exc})"
                rejected.append(self._reject(entry, Rejected(RejectionReason.CORRUPT, detail)))
                continue
            seen.add(decoded.sha256)
            ranges.record(decoded.info)
            accepted.append(_Accepted(entry, decoded, staleness))
        return accepted, rejected, duplicates

    @staticmethod
    def _check_range(info: DeltaInfo, ranges: Ledger) -> None:
        """``Rejected(OVERLAP)`` when ``info``'s step range reaches back into steps applied
        (or accepted in this round) from its node incarnation: the same samples would
        count twice (a resumed node of an earlier version resending them, or a second
        process with this node id)."""
        through = ranges.overlap(info)
        if through is None:
            return
        start = info.local_step - 1 if info.first_step is None else info.first_step
        raise Rejected(
            RejectionReason.OVERLAP,
            f"delta holds local steps {start + 1}..{info.local_step} of node "
            f"{info.node_id!r}, whose steps up to {through} were applied already",
        )

    def _screen(
        self, state: OuterState, accepted: list[_Accepted], rejected: list[DeltaRejection]
    ) -> list[_Accepted]:
        """Outlier screening of the round's deltas (``aggregation.screen``): returns the
        deltas kept, with their norms and clip factors set; rejected outliers join
        ``rejected``. Deltas of one streaming fragment are judged together, against that
        fragment's history (a fragment's norm is not comparable with another's or the
        model's)."""
        for item in accepted:
            item.norm = state_norm(item.decoded.tensors)
        groups: dict[str, list[_Accepted]] = {}
        for item in accepted:
            groups.setdefault(item.decoded.info.fragment, []).append(item)
        bounds: dict[int, float | None] = {}
        for fragment, members in groups.items():
            keys = (list(members[0].decoded.tensors) if fragment else None) or self.layout.sync_keys
            model_norm = partial(state_norm, state.global_state, keys)
            screening = self._norms.judge(fragment, [m.norm for m in members], model_norm)
            for member, factor in zip(members, screening.factors, strict=True):
                member.clip, bounds[id(member)] = factor, screening.bound
        kept: list[_Accepted] = []
        for item in accepted:
            bound = bounds[id(item)]
            if item.clip == 0.0:
                detail = f"pseudo-gradient norm {item.norm:.4g} exceeds the bound {bound}"
                rejected.append(self._reject(item.entry, Rejected(RejectionReason.OUTLIER, detail)))
                continue
            if item.clip != 1.0:
                logger.warning(
                    "diloco master clipped %s: pseudo-gradient norm %.4g is above %.4g "
                    "(outlier_factor x the recent median)",
                    item.entry.path,
                    item.norm,
                    bound,
                )
            kept.append(item)
        return kept

    # -- work weighting ------------------------------------------------------------------

    def observe_step_work(self, tokens: int, samples: int) -> None:
        """The tokens and samples one optimizer step of this master's own training took
        (its node reports them at each capture); the largest seen is the default per-step
        cap of a delta's claimed work (``max_step_tokens`` / ``max_step_samples``)."""
        with self._lock:
            self._step_work = (max(self._step_work[0], tokens), max(self._step_work[1], samples))

    def _per_step(self, unit: str) -> int | None:
        """The most ``unit`` one optimizer step of any node may claim (``None``: unknown)."""
        settings = self.settings
        configured = settings.max_step_tokens if unit == "tokens" else settings.max_step_samples
        if configured is not None:
            return configured
        with self._lock:
            measured = self._step_work[0 if unit == "tokens" else 1]
        return measured or None

    def _work_shares(
        self, accepted: list[_Accepted], rejected: list[DeltaRejection]
    ) -> tuple[list[_Accepted], str]:
        """Each delta's share of the round's work (``weight_by_work``), and the unit:
        a claimed figure above what its node could have trained (``aggregation.work_cap``)
        counts as that much, and the capped figures are screened like norms (clipped to,
        or left out above, ``outlier_factor`` x the median of recent figures). Shares are
        ``work / mean(work)``: equal work weighs exactly 1."""
        if not accepted or not self.settings.weight_by_work:
            return accepted, ""
        infos = [item.decoded.info for item in accepted]
        unit = work_unit([i.tokens for i in infos], [i.samples for i in infos])
        if unit is None:
            return accepted, ""
        per_step = self._per_step(unit)
        figures: list[float] = []
        for item, info in zip(accepted, infos, strict=True):
            claim = info.tokens if unit == "tokens" else info.samples
            cap = work_cap(info.steps, self.settings.inner_steps, per_step)
            if cap is not None and claim > cap:
                # A cumulative delta of several periods is capped quietly; a claim its
                # own step range could not hold is reported.
                holds = work_cap(info.steps, None, per_step)
                if holds is None or claim > holds:
                    self._log_cap(item.entry.path, info, claim, cap, unit)
                claim = cap
            figures.append(float(claim))
        screening = self._works.judge(unit, figures)
        kept = self._apply_work_screening(accepted, figures, screening, unit, rejected)
        if kept:
            for item, share in zip(kept, work_shares([item.work for item in kept]), strict=True):
                item.share = share
        return kept, unit

    def _apply_work_screening(
        self,
        accepted: list[_Accepted],
        figures: list[float],
        screening: Screening,
        unit: str,
        rejected: list[DeltaRejection],
    ) -> list[_Accepted]:
        kept: list[_Accepted] = []
        for item, figure, factor in zip(accepted, figures, screening.factors, strict=True):
            if factor == 0.0:
                detail = (
                    f"claimed work of {figure:.6g} {unit} exceeds the bound "
                    f"{screening.bound:.6g} (outlier_factor x the recent median)"
                )
                rejected.append(self._reject(item.entry, Rejected(RejectionReason.OUTLIER, detail)))
                continue
            if factor != 1.0:
                logger.warning(
                    "diloco master clipped the work of %s: %.6g %s is above %.6g "
                    "(outlier_factor x the recent median)",
                    item.entry.path,
                    figure,
                    unit,
                    screening.bound,
                )
            item.work = figure * factor
            kept.append(item)
        return kept

    def _log_cap(self, path: str, info: DeltaInfo, claim: int, cap: int, unit: str) -> None:
        """One WARNING per node whose claimed work was capped (each cap is in the audit)."""
        with self._lock:
            first = info.node_id not in self._capped
            self._capped.add(info.node_id)
        if first:
            logger.warning(
                "diloco master capped the claimed work of %s: %d %s is more than node %r "
                "could have trained (%d: at most inner_steps steps of max_step_%s); the "
                "audit log has every capped figure",
                path,
                claim,
                unit,
                info.node_id,
                cap,
                unit,
            )

    def _download(self, entry: RemoteFile, name: DeltaName) -> DecodedDelta | None:
        """Read and decode one candidate (``None`` if it vanished). Files that are not
        regular files or exceed the size limit are refused before any byte is read."""
        limit = self.transport.max_file_bytes
        if limit is not None and entry.size > limit:
            raise Rejected(
                RejectionReason.TOO_LARGE, f"file is {entry.size} bytes, the limit is {limit}"
            )
        try:
            data = self.transport.get(entry.path)
        except UnreadableFileError as exc:
            reason = RejectionReason.TOO_LARGE if exc.too_large else RejectionReason.UNSAFE_FILE
            raise Rejected(reason, exc.message) from None
        if data is None:
            return None
        decoded = decode_delta(data, self.layout, secret=self.settings.secret)
        info = decoded.info
        if (
            info.node_id != name.node_id
            or info.local_step != name.local_step
            or not decoded.sha256.startswith(name.hash_prefix)
        ):
            raise Rejected(
                RejectionReason.NAME_MISMATCH,
                f"header says node {info.node_id!r} step {info.local_step}, hash "
                f"{decoded.sha256[:16]}; the path disagrees",
            )
        return decoded

    def _staleness(self, decoded: DecodedDelta, outer_step: int) -> int:
        """How many outer steps old the delta's base is; ``Rejected`` when it has no base,
        a base from the future, or is older than ``max_staleness``."""
        info = decoded.info
        if info.base_outer_step < 0:
            raise Rejected(RejectionReason.BAD_METADATA, "delta has no base outer step")
        if info.base_outer_step > outer_step:
            raise Rejected(
                RejectionReason.FUTURE_BASE,
                f"delta starts from outer step {info.base_outer_step}, the hub is at {outer_step}",
            )
        staleness = outer_step - info.base_outer_step
        limit = self.settings.max_staleness
        if limit is not None and staleness > limit:
            raise Rejected(
                RejectionReason.TOO_STALE, f"staleness {staleness} exceeds max_staleness {limit}"
            )
        return staleness

    def _reject(self, entry: RemoteFile, exc: Rejected) -> DeltaRejection:
        """Record and log a rejected file. It stays on the hub for inspection; it is not
        examined again until it changes."""
        with self._lock:
            self._rejected[entry.path] = entry.version
        logger.warning(
            "diloco master rejected %s (%s): %s", entry.path, exc.reason.value, exc.detail
        )
        return DeltaRejection(entry.path, exc.reason, exc.detail)

    # -- publication -------------------------------------------------------------------

    def _check_pointer(self) -> str | None:
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
        expected = self._expected_pointer
        if expected is None or (pointer.outer_step, pointer.master) == expected:
            return None
        current = self.outer_step
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
        state = self.snapshot()
        assert state is not None  # reconciled
        self._expected_pointer = (pointer.outer_step, pointer.master)  # knowingly replaced
        self._publish(state, applied=(), deletes=self._stale_globals(state.outer_step))

    def _adopt_own(self, pointer: Pointer) -> None:
        """Our own publication that we counted as failed (a timed-out request that
        completed after all): the hub is the truth."""
        logger.warning(
            "diloco master %s: the hub holds outer step %d written under this node id; adopting it",
            self.settings.node_id,
            pointer.outer_step,
        )
        state = self._adopt(pointer)
        with self._lock:
            self._state = state
        self._expected_pointer = (pointer.outer_step, pointer.master)

    def _halt(self, reason: str) -> None:
        self.halted = reason
        logger.error("diloco master stops aggregating: %s", reason)
        raise MasterConflictError(reason)

    def _publish(
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
        expected = self._expected_pointer
        if self.transport.atomic_commit:
            self.transport.commit([*files, (POINTER_PATH, pointer_bytes)], removals)
            self._expected_pointer = (step, self.settings.node_id)
            return pointer
        self.transport.commit(files)
        replaced = self.transport.replace(POINTER_PATH, pointer_bytes)
        self._expected_pointer = (step, self.settings.node_id)
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

    def _delete(self, paths: list[str]) -> None:
        if self.settings.delete_applied:
            delete_applied(self.transport, paths)

    def _stale_globals(self, outer_step: int) -> list[str]:
        """Global files this master no longer keeps (``hub_gc.stale_globals``)."""
        return stale_globals(self.transport, outer_step, self.settings.keep_global_versions)

    def _audit(self, report: RoundReport) -> None:
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
                {
                    "sha256": item.sha256,
                    "node_id": item.node_id,
                    "local_step": item.local_step,
                    "base_outer_step": item.base_outer_step,
                    "staleness": item.staleness,
                    "weight": item.weight,
                    "norm": item.norm,
                    "clip": item.clip,
                    "tokens": item.tokens,
                    "samples": item.samples,
                    "first_step": item.first_step,
                    "work": item.work,
                }
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


def _is_applied(sha256: str, applied: set[str]) -> bool:
    """Whether a delta's content hash is in a ledger (which may hold bare 16-character
    prefixes when it was rebuilt from file names after the outer state was lost)."""
    return sha256 in applied or sha256[:16] in applied


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
