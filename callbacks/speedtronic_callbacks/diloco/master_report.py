"""What the hub master is configured with and what one of its rounds reports
(``MasterSettings``, ``RoundReport``, ``AppliedDelta``, ``DeltaRejection``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from speedtronic_callbacks.diloco.aggregation import RobustSettings
from speedtronic_callbacks.diloco.outer_round import Contribution
from speedtronic_callbacks.diloco.transport_base import RemoteFile
from speedtronic_callbacks.diloco.wire import DecodedDelta, RejectionReason


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
    """A delta that passed validation, on its way through one round (its figures are the
    round's ``Contribution``)."""

    entry: RemoteFile
    decoded: DecodedDelta
    contribution: Contribution

    def applied(self, weight: float) -> AppliedDelta:
        """What the round's report says of this delta once applied with ``weight``."""
        info, figures = self.decoded.info, self.contribution
        return AppliedDelta(
            path=self.entry.path,
            sha256=self.decoded.sha256,
            node_id=info.node_id,
            local_step=info.local_step,
            base_outer_step=info.base_outer_step,
            staleness=figures.staleness,
            weight=weight,
            norm=figures.norm,
            clip=figures.clip,
            tokens=info.tokens,
            samples=info.samples,
            first_step=info.first_step,
            work=figures.work,
        )


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
