"""What a master round accepts (``master``, steps 1-3): the candidate delta files under
``nodes/``, each downloaded and validated (signature, fingerprint, keys, shapes, hash,
staleness, step-range overlap), their norms screened for outliers per streaming fragment,
and their claimed work capped and screened into work shares. Every failure is a logged
rejection that quarantines the file; the round goes on without it."""

from __future__ import annotations

import logging
import threading

from speedtronic_callbacks.diloco.aggregation import (
    NormHistory,
    Screening,
    Screens,
    state_norm,
    work_cap,
    work_shares,
    work_unit,
)
from speedtronic_callbacks.diloco.hub_files import (
    DeltaName,
    OuterState,
    parse_delta_path,
)
from speedtronic_callbacks.diloco.master_report import (
    DeltaRejection,
    MasterSettings,
    _Accepted,
)
from speedtronic_callbacks.diloco.model_layout import ModelLayout
from speedtronic_callbacks.diloco.outer_round import Contribution, OuterRound
from speedtronic_callbacks.diloco.transport_base import (
    RemoteFile,
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
    decode_delta,
)

logger = logging.getLogger("speedtronic.diloco")


def _is_applied(sha256: str, applied: set[str]) -> bool:
    """Whether a delta's content hash is in a ledger (which may hold bare 16-character
    prefixes when it was rebuilt from file names after the outer state was lost)."""
    return sha256 in applied or sha256[:16] in applied


class DeltaIntake:
    """The intake of a master round (steps 1-3 of ``master``), held by ``MasterLoop``: it
    owns what it needs across rounds -- the quarantine of rejected files, the applied files
    seen, the work claims' history and the measured per-step work -- and judges norms
    through the master's ``OuterRound``."""

    def __init__(
        self,
        transport: Transport,
        layout: ModelLayout,
        settings: MasterSettings,
        round_: OuterRound,
    ) -> None:
        self.transport = transport
        self.layout = layout
        self.settings = settings
        self.round = round_
        self._lock = threading.Lock()
        self.rejected: dict[str, str] = {}
        """Quarantined files: path -> the version examined (reported once; checkpointed)."""
        self.known_applied: dict[str, str] = {}
        self.works = Screens(settings.robust)
        """Recent applied work figures per unit (``tokens``, ``samples``)."""
        self.step_work = (0, 0)
        """The most tokens and samples one step of this master's own training took (0:
        not measured yet), the default per-step work cap."""
        self._capped: set[str] = set()
        """Nodes whose claimed work was capped (logged once per node)."""

    def quarantine(self) -> dict[str, str]:
        """A copy of the quarantined files (for the master's checkpoint)."""
        with self._lock:
            return dict(self.rejected)

    def restore(
        self,
        rejected: dict[str, str] | None,
        works: dict[str, NormHistory],
        step_work: tuple[int, int],
    ) -> None:
        """Install a checkpoint's quarantine (``None``: keep it), work history and step work."""
        with self._lock:
            self.works.histories = works
            self.step_work = step_work
            if rejected is not None:
                self.rejected = rejected

    def candidates(self, cleanup: list[str]) -> list[tuple[RemoteFile, DeltaName]]:
        """The delta files under ``nodes/`` to examine this round, by node and step. An
        applied one seen before joins ``cleanup``; a quarantined one (rejected before and
        unchanged) is skipped. Records of files no longer listed are forgotten, so the
        quarantine list stays as long as the hub's own listing."""
        listed = self.transport.list_files("nodes")
        paths = {entry.path for entry in listed}
        with self._lock:
            self.rejected = {p: v for p, v in self.rejected.items() if p in paths}
            self.known_applied = {p: v for p, v in self.known_applied.items() if p in paths}
        candidates: list[tuple[RemoteFile, DeltaName]] = []
        for entry in listed:
            name = parse_delta_path(entry.path)
            if name is None:
                continue
            if self.known_applied.get(entry.path) == entry.version:
                cleanup.append(entry.path)  # checked before: an applied delta, unchanged
                continue
            if self.rejected.get(entry.path) == entry.version:
                continue  # quarantined: examined before, unchanged, reported once already
            candidates.append((entry, name))
        candidates.sort(key=lambda item: (item[1].node_id, item[1].local_step, item[0].path))
        return candidates

    def validate(
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
                        self.known_applied[entry.path] = entry.version
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
            accepted.append(_Accepted(entry, decoded, Contribution(0.0, staleness)))
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
            self.rejected[entry.path] = entry.version
        logger.warning(
            "diloco master rejected %s (%s): %s", entry.path, exc.reason.value, exc.detail
        )
        return DeltaRejection(entry.path, exc.reason, exc.detail)

    def screen(
        self, state: OuterState, accepted: list[_Accepted], rejected: list[DeltaRejection]
    ) -> list[_Accepted]:
        """Outlier screening of the round's deltas (``aggregation.screen``): returns the
        deltas kept, with their norms and clip factors set; rejected outliers join
        ``rejected``. Deltas of one streaming fragment are judged together, against that
        fragment's history (a fragment's norm is not comparable with another's or the
        model's)."""
        for item in accepted:
            item.contribution.norm = state_norm(item.decoded.tensors)
        groups: dict[str, list[_Accepted]] = {}
        for item in accepted:
            groups.setdefault(item.decoded.info.fragment, []).append(item)
        bounds: dict[int, float | None] = {}
        for fragment, members in groups.items():
            keys = (list(members[0].decoded.tensors) if fragment else None) or self.layout.sync_keys
            contributions = [m.contribution for m in members]
            screening = self.round.judge(fragment, contributions, state.global_state, keys)
            for member in members:
                bounds[id(member)] = screening.bound
        kept: list[_Accepted] = []
        for item in accepted:
            bound, norm = bounds[id(item)], item.contribution.norm
            refusal = f"pseudo-gradient norm {norm:.4g} exceeds the bound {bound}"
            clipped = "diloco master clipped %s: pseudo-gradient norm %.4g is above %.4g"
            if self._keeps(item, item.contribution.clip, rejected, refusal, clipped, norm, bound):
                kept.append(item)
        return kept

    def _keeps(
        self,
        item: _Accepted,
        factor: float,
        rejected: list[DeltaRejection],
        refusal: str,
        clipped: str,
        *figures: object,
    ) -> bool:
        """Whether an outlier verdict ``factor`` keeps ``item``: 0 makes it a logged
        ``outlier`` rejection (``refusal``), a factor below 1 a WARNING (``clipped`` with the
        path and ``figures``)."""
        if factor == 0.0:
            rejected.append(self._reject(item.entry, Rejected(RejectionReason.OUTLIER, refusal)))
            return False
        if factor != 1.0:
            logger.warning(
                clipped + " (outlier_factor x the recent median)", item.entry.path, *figures
            )
        return True

    def observe_step_work(self, tokens: int, samples: int) -> None:
        """The tokens and samples one optimizer step of this master's own training took
        (its node reports them at each capture); the largest seen is the default per-step
        cap of a delta's claimed work (``max_step_tokens`` / ``max_step_samples``)."""
        with self._lock:
            self.step_work = (max(self.step_work[0], tokens), max(self.step_work[1], samples))

    def _per_step(self, unit: str) -> int | None:
        """The most ``unit`` one optimizer step of any node may claim (``None``: unknown)."""
        settings = self.settings
        configured = settings.max_step_tokens if unit == "tokens" else settings.max_step_samples
        if configured is not None:
            return configured
        with self._lock:
            measured = self.step_work[0 if unit == "tokens" else 1]
        return measured or None

    def work_shares(
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
        screening = self.works.judge(unit, figures)
        kept = self._apply_work_screening(accepted, figures, screening, unit, rejected)
        if kept:
            figures = [item.contribution.work for item in kept]
            for item, share in zip(kept, work_shares(figures), strict=True):
                item.contribution.share = share
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
        bound = screening.bound
        clipped = "diloco master clipped the work of %s: %.6g %s is above %.6g"
        for item, figure, factor in zip(accepted, figures, screening.factors, strict=True):
            refusal = (
                ""
                if factor
                else f"claimed work of {figure:.6g} {unit} exceeds the bound "
                f"{bound:.6g} (outlier_factor x the recent median)"
            )
            if self._keeps(item, factor, rejected, refusal, clipped, figure, unit, bound):
                item.contribution.work = figure * factor
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
