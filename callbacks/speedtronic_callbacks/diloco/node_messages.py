"""What a DiLoCo node's background lanes hand back to its training thread (``node``):
upload jobs and their results, fetched global candidates, master rounds, the outcome of
one step and the node's counters."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from speedtronic_callbacks.diloco.master import RoundReport


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
