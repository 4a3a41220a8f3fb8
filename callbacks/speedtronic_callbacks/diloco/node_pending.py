"""A DiLoCo node's unsent work (``node``): the pending delta, the progress folded into
it, the tokens and samples trained for it, and the part of it one streaming fragment
sends. Everything here runs on the training thread."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from speedtronic_callbacks.diloco.fragments import FragmentPlan
from speedtronic_callbacks.diloco.lanes import ErrorReporter
from speedtronic_callbacks.diloco.master import MasterLoop
from speedtronic_callbacks.diloco.model_layout import ModelLayout
from speedtronic_callbacks.diloco.node_messages import (
    GlobalCandidate,
    NodeStats,
    UploadJob,
)
from speedtronic_callbacks.diloco.transport_base import (
    RetryingTransport,
)

if TYPE_CHECKING:
    from speedtronic_callbacks.diloco.node import NodeSettings
    from speedtronic_callbacks.diloco.node_jobs import NodeJobs


def snapshot_weights(model: nn.Module, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    return {key: state[key].detach().to("cpu", copy=True) for key in keys}


def all_zero(delta: Mapping[str, torch.Tensor]) -> bool:
    return not any(bool(t.any()) for t in delta.values())


def all_finite(delta: Mapping[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in delta.values())


def merge_held(
    first: dict[str, torch.Tensor] | None, second: dict[str, torch.Tensor] | None
) -> dict[str, torch.Tensor] | None:
    if first is None:
        return second
    if second is None:
        return first
    return {key: first[key].to(torch.float32) + second[key].to(torch.float32) for key in first}


class PendingWork:
    """The pending-work part of ``DiLoCoNode`` (its attributes are set by
    ``DiLoCoNode.__init__``)."""

    model: nn.Module
    transport: RetryingTransport
    layout: ModelLayout
    settings: NodeSettings
    plan: FragmentPlan
    master: MasterLoop | None
    reporter: ErrorReporter
    jobs: NodeJobs
    installed_step: int
    installed_global: Mapping[str, torch.Tensor] | None
    baseline: dict[str, torch.Tensor] | None
    pending: dict[str, torch.Tensor] | None
    pending_base: int
    pending_work: tuple[int, int]
    unconfirmed: UploadJob | None
    stats: NodeStats
    _clock: Callable[[], float]
    _publish: Callable[[str, Mapping[str, object]], None]
    _work_now: tuple[int, int]
    _work_mark: tuple[int, int]
    _held_work: tuple[int, int]
    _held_pending: dict[str, torch.Tensor] | None
    _held_base: int
    _checkpoint_step: int | None
    _range_starts: list[int] | None
    _baseline_step: int
    _skip: dict[int, int] | None
    _skip_work: int
    _dispatched_through: int
    _work_step: int | None
    _foreign_logged: bool
    _startup_done: bool
    _resync: bool
    _candidate: GlobalCandidate | None
    _captured_step: int | None
    _last_step: int
    _last_poll: float
    _last_round: float
    _started: bool

    @property
    def acts_as_master(self) -> bool:
        return self.master is not None and self.master.halted is None

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
            if all_zero(pending):
                return None
            self.pending = None
            return pending, ""
        keys = self.plan.fragments[fragment]
        part = {key: pending[key] for key in keys}
        if all_zero(part):
            return None
        self.pending = {
            key: self._zeros(key) if key in part else value for key, value in pending.items()
        }
        return part, self.plan.name(fragment)
