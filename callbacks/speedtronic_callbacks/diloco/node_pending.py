"""A DiLoCo node's unsent work (``node``): the pending delta, the progress folded into
it, the tokens and samples trained for it, and the part of it one streaming fragment
sends. Everything here runs on the training thread."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from speedtronic_callbacks.diloco.fragments import FragmentPlan
from speedtronic_callbacks.diloco.master import MasterLoop
from speedtronic_callbacks.diloco.model_layout import ModelLayout
from speedtronic_callbacks.diloco.node_messages import (
    UploadJob,
)

if TYPE_CHECKING:
    pass


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
    """A node's unsent work: the pending delta (every synchronised key, float32) with the
    global it stands on and the tokens and samples trained for it; the work held back
    at a resume until the hub says what was sent; each fragment's range start; and what
    an earlier life of this node already sent (``skip``)."""

    def __init__(self, layout: ModelLayout, plan: FragmentPlan, master: MasterLoop | None) -> None:
        self.layout = layout
        self.plan = plan
        self.master = master
        """Told what one step trains (``take_work``) on the master's node."""
        self.pending: dict[str, torch.Tensor] | None = None
        self.pending_base = -1
        self.pending_work = (0, 0)
        """Tokens and samples trained for ``pending`` (sent with it as upload metadata)."""
        self.work_now = (0, 0)
        self.work_mark = (0, 0)
        self.work_step: int | None = None
        """The step ``work_mark`` was taken at (the master measures its step's work)."""
        self.held_pending: dict[str, torch.Tensor] | None = None
        """Checkpointed unsent work, held until the hub says it was not sent after it."""
        self.held_base = -1
        self.held_work = (0, 0)
        self.range_starts: list[int] | None = None
        """Per fragment, the step after which its pending progress begins (its next
        delta's ``first_step``)."""
        self.skip: dict[int, int] | None = None
        """Per fragment, the local step through which an earlier life of this node sent
        its progress (set on resume; ``drop_sent``)."""
        self.skip_work = -1
        """The step through which that earlier life reported its tokens and samples."""
        self.dispatched_through = -1
        """The highest local step of a delta this incarnation handed to the upload lane."""
        self.unconfirmed: UploadJob | None = None
        """The job handed to the upload lane and not confirmed yet (re-sent as is)."""

    def record_work(self, tokens: int, samples: int) -> None:
        """The trainer's token and sample counters now (called before ``on_step``); what
        they grew by since the last capture travels with the delta (``weight_by_work``)."""
        self.work_now = (tokens, samples)

    def take_work(self, step: int) -> tuple[int, int]:
        """The tokens and samples trained since the last capture; a master also tells its
        loop what one of its steps trains (the default cap of a delta's claimed work)."""
        now, mark = self.work_now, self.work_mark
        self.work_mark = now
        work = (max(0, now[0] - mark[0]), max(0, now[1] - mark[1]))
        steps = 0 if self.work_step is None else step - self.work_step
        self.work_step = step
        if self.master is not None and steps > 0:
            self.master.observe_step_work(-(-work[0] // steps), -(-work[1] // steps))
        return work

    def drop_sent(
        self, segment: dict[str, torch.Tensor], work: tuple[int, int], step: int, start: int
    ) -> tuple[dict[str, torch.Tensor], tuple[int, int]]:
        """The part of ``segment`` (the progress from the baseline taken at ``start`` to
        ``step``) that an earlier life of this node has not sent: a fragment's progress
        trained from a baseline before the step it was sent through is dropped (those
        samples are on the hub already) and its range restarts here; so are the segment's
        tokens and samples when it began before the step they were reported through.
        Skipping ends once every such step is passed."""
        assert self.skip is not None and self.range_starts is not None
        for fragment, through in self.skip.items():
            if start < through:
                for key in self.plan.fragments[fragment]:
                    segment[key] = torch.zeros_like(segment[key])
                self.range_starts[fragment] = step
        if start < self.skip_work:
            work = (0, 0)
        if step >= max(self.skip_work, *self.skip.values()):
            self.skip = None
        return segment, work

    def add(
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

    def drop(self, step: int) -> None:
        """Forget the pending delta (its work too); every fragment's range restarts here."""
        self.pending = None
        self.pending_work = (0, 0)
        self.range_starts = [step] * self.plan.count

    def _zeros(self, key: str) -> torch.Tensor:
        return torch.zeros(self.layout.wire_shapes[key], dtype=torch.float32)

    def take_fragment(self, fragment: int) -> tuple[dict[str, torch.Tensor], str] | None:
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
