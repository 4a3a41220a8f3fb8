"""The event list: every point in a fit where callbacks run, in the order they run.

This file is the single source of truth for the event contract. The per-step loop
(`speedtronic.loop`) emits exactly these events in exactly this order; the docs page
`docs/events.md` and the golden-trace tests are written against it.
"""

from __future__ import annotations

import enum


class Event(str, enum.Enum):
    """A lifecycle event. The value is the event's name; the hook is ``on_<value>``."""

    SETUP = "setup"
    FIT_START = "fit_start"
    STEP_START = "step_start"
    MICROBATCH_START = "microbatch_start"
    BEFORE_BACKWARD = "before_backward"
    AFTER_BACKWARD = "after_backward"
    MICROBATCH_END = "microbatch_end"
    BEFORE_OPTIMIZER_STEP = "before_optimizer_step"
    AFTER_OPTIMIZER_STEP = "after_optimizer_step"
    AFTER_SCHEDULER_STEP = "after_scheduler_step"
    COORDINATE = "coordinate"
    OPTIMIZER_RESET = "optimizer_reset"
    METRICS = "metrics"
    CHECKPOINT = "checkpoint"
    STEP_END = "step_end"
    FIT_END = "fit_end"
    EXCEPTION = "exception"
    TEARDOWN = "teardown"

    @property
    def hook_name(self) -> str:
        return f"on_{self.value}"


#: Events emitted once per microbatch, K times per global step.
MICROBATCH_EVENTS: tuple[Event, ...] = (
    Event.MICROBATCH_START,
    Event.BEFORE_BACKWARD,
    Event.AFTER_BACKWARD,
    Event.MICROBATCH_END,
)

#: Events emitted once per global step after the K microbatches, in order.
#: ``OPTIMIZER_RESET`` is emitted only when a callback asked for a reset at
#: ``COORDINATE`` and resets are enabled.
STEP_TAIL_EVENTS: tuple[Event, ...] = (
    Event.BEFORE_OPTIMIZER_STEP,
    Event.AFTER_OPTIMIZER_STEP,
    Event.AFTER_SCHEDULER_STEP,
    Event.COORDINATE,
    Event.OPTIMIZER_RESET,
    Event.METRICS,
    Event.CHECKPOINT,
    Event.STEP_END,
)

#: Events whose failures stop the run: everything except pure observation.
#: Observer callbacks (``Callback.is_observer = True``) warn and continue instead.
ALL_EVENTS: tuple[Event, ...] = tuple(Event)


def expected_step_trace(accumulation_steps: int, *, optimizer_reset: bool = False) -> list[Event]:
    """The exact event sequence of one global step with K = ``accumulation_steps``."""
    trace = [Event.STEP_START]
    trace += list(MICROBATCH_EVENTS) * accumulation_steps
    for event in STEP_TAIL_EVENTS:
        if event is Event.OPTIMIZER_RESET and not optimizer_reset:
            continue
        trace.append(event)
    return trace
