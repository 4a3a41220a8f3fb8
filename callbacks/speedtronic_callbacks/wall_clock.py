"""Wall-clock deadlines that every rank of a run sees pass at the same step.

The ``time_budget`` callback (stop when ``run.max_time`` is spent) and the ``checkpoint``
callback (``every_minutes``) ask once per step whether a deadline has passed. One process
answers from its own clock: one ``time.monotonic()`` per step, nothing else. Ranks of a
multi-rank run must answer alike -- a save is a collective, a stop must happen on every
rank -- and their clocks differ, so there rank 0's clock decides, and the decision is
broadcast. Not every step, though: rank 0 plans the *decision steps*.

At a decision step rank 0 reads its clock and broadcasts two integers, one collective:
whether the deadline has passed, and the step of the next decision. It plans that step
from the step time it measured since the previous decision, to land at half the time
still left (at least one step ahead): the plan converges on the deadline geometrically,
so a deadline ``T`` away at ``dt`` per step takes about ``log2(T / dt)`` broadcasts -- 14
for four hours at one step per second -- and a step time that doubles between two
decisions still does not overshoot it. Between decision steps no rank does anything.
The first decision of a fit is its first step (no step time is known before it), and the
first after a deadline passed (and was moved by ``restart``) the step after.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from speedtronic.systems.distributed import DistributedContext

__all__ = ["Deadline"]

_MAX_AHEAD = 1 << 40  # steps: far beyond any run, well inside int64


class Deadline:
    """A point in wall-clock time, asked about once per step (``passed``), answered alike on
    every rank. ``distributed``: the run's rank information (``None`` or one rank: the
    local clock decides every step)."""

    def __init__(self, distributed: DistributedContext | None = None) -> None:
        self._distributed = (
            distributed if distributed is not None and distributed.world_size > 1 else None
        )
        self._deadline = float("inf")
        self._next_decision = 0  # a step: asked before it, every rank answers False
        self._last: tuple[int, float] | None = None  # (step, time) of the last decision
        self.decisions = 0
        """Decisions taken so far (each one broadcast in a multi-rank run)."""

    @property
    def multi_rank(self) -> bool:
        return self._distributed is not None

    def start_at(self, deadline: float, *, step: int) -> None:
        """Make ``deadline`` (``time.monotonic()`` seconds; rank 0's counts) the one asked
        about, from the step after ``step`` on."""
        self._deadline = deadline
        self._next_decision = step + 1

    def passed(self, step: int) -> bool:
        """Whether the deadline has passed by the end of ``step`` (call it on every rank at
        the same point of every step; a collective at decision steps only)."""
        if self._distributed is None:
            return time.monotonic() >= self._deadline
        if step < self._next_decision:
            return False
        return self._decide(step, self._distributed)

    def _decide(self, step: int, distributed: DistributedContext) -> bool:
        import torch.distributed as dist

        plan = [0, step + 1]
        if distributed.is_main:
            plan = self._plan(step, time.monotonic())
        message = torch.tensor(plan, dtype=torch.int64, device=distributed.collective_device)
        dist.broadcast(message, src=0)
        due, self._next_decision = (int(value) for value in message.tolist())
        self.decisions += 1
        return bool(due)

    def _plan(self, step: int, now: float) -> list[int]:
        """Rank 0: ``[passed, next decision step]`` from its clock and measured step time."""
        previous, self._last = self._last, (step, now)
        if now >= self._deadline:
            return [1, step + 1]
        ahead = 1
        if previous is not None and step > previous[0] and now > previous[1]:
            step_time = (now - previous[1]) / (step - previous[0])
            ahead = max(1, min(_MAX_AHEAD, int(0.5 * (self._deadline - now) / step_time)))
        return [0, step + ahead]
