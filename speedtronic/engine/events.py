"""The event list: every point in a fit where callbacks run, in the order they run.

This file is the single source of truth for the event contract. The per-step loop
(`speedtronic.engine.loop`) emits exactly these events in exactly this order; the docs page
`docs/events.md` and the golden-trace tests are written against it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Generic, TypeVar, final

from speedtronic.engine.contexts import (
    BackwardContext,
    CheckpointContext,
    CoordinateContext,
    EvalEndContext,
    EvalStartContext,
    ExceptionContext,
    FitContext,
    FitEndContext,
    MetricsContext,
    MicrobatchContext,
    OptimizerResetContext,
    OptimizerStepContext,
    SchedulerContext,
    StepContext,
    TeardownContext,
)

CtxT = TypeVar("CtxT")


class Event(str, enum.Enum):
    """A lifecycle event. The value is the event's name; the hook is ``on_<value>``.

    Where each runs, as ``Trainer.fit`` and ``loop.run_global_step`` run them (K microbatches
    per global step)::

        setup, fit_start
        while step < target_step and no stop was requested:
            step_start
            K times: microbatch_start, forward, before_backward, backward, after_backward,
                     microbatch_end
            before_optimizer_step     gradients complete and unscaled
            optimizer.step()
            after_optimizer_step      the fp16 scaler skipped the update: step_end, retry
            scheduler.step()
            after_scheduler_step
            coordinate
            optimizer_reset           only when asked for and allowed
            eval_start, eval_end      only on evaluation steps
            metrics
            checkpoint
            step_end
        fit_end
        teardown                      always; after exception when the fit failed
    """

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
    EVAL_START = "eval_start"
    EVAL_END = "eval_end"
    METRICS = "metrics"
    CHECKPOINT = "checkpoint"
    STEP_END = "step_end"
    FIT_END = "fit_end"
    EXCEPTION = "exception"
    TEARDOWN = "teardown"

    @property
    def hook_name(self) -> str:
        return f"on_{self.value}"


class EventKey:
    """An event and the type of the context its hooks receive (untyped view of ``EventSpec``)."""

    __slots__ = ("event", "context_type")

    def __init__(self, event: Event, context_type: type[object]) -> None:
        self.event = event
        self.context_type = context_type

    def __repr__(self) -> str:
        return f"On.{self.event.name}({self.context_type.__name__})"


@final
class EventSpec(EventKey, Generic[CtxT]):
    """The typed key the engine emits an event with: ``plan.emit(trainer, On.STEP_END, ctx)``
    only type-checks when ``ctx`` is the event's context type. Hashing is by identity (fast)."""

    __slots__ = ()

    def __init__(self, event: Event, context_type: type[CtxT]) -> None:
        super().__init__(event, context_type)


class On:
    """THE event table: every event with its context type, in emission order.

    The engine emits with these keys (mypy rejects a wrong context for an event), the
    ``Callback`` hooks are typed to match (a test checks each signature against this table),
    and ``CONTEXT_TYPES`` is derived from it.
    """

    SETUP = EventSpec(Event.SETUP, FitContext)
    FIT_START = EventSpec(Event.FIT_START, FitContext)
    STEP_START = EventSpec(Event.STEP_START, StepContext)
    MICROBATCH_START = EventSpec(Event.MICROBATCH_START, MicrobatchContext)
    BEFORE_BACKWARD = EventSpec(Event.BEFORE_BACKWARD, BackwardContext)
    AFTER_BACKWARD = EventSpec(Event.AFTER_BACKWARD, BackwardContext)
    MICROBATCH_END = EventSpec(Event.MICROBATCH_END, MicrobatchContext)
    BEFORE_OPTIMIZER_STEP = EventSpec(Event.BEFORE_OPTIMIZER_STEP, OptimizerStepContext)
    AFTER_OPTIMIZER_STEP = EventSpec(Event.AFTER_OPTIMIZER_STEP, OptimizerStepContext)
    AFTER_SCHEDULER_STEP = EventSpec(Event.AFTER_SCHEDULER_STEP, SchedulerContext)
    COORDINATE = EventSpec(Event.COORDINATE, CoordinateContext)
    OPTIMIZER_RESET = EventSpec(Event.OPTIMIZER_RESET, OptimizerResetContext)
    EVAL_START = EventSpec(Event.EVAL_START, EvalStartContext)
    EVAL_END = EventSpec(Event.EVAL_END, EvalEndContext)
    METRICS = EventSpec(Event.METRICS, MetricsContext)
    CHECKPOINT = EventSpec(Event.CHECKPOINT, CheckpointContext)
    STEP_END = EventSpec(Event.STEP_END, StepContext)
    FIT_END = EventSpec(Event.FIT_END, FitEndContext)
    EXCEPTION = EventSpec(Event.EXCEPTION, ExceptionContext)
    TEARDOWN = EventSpec(Event.TEARDOWN, TeardownContext)


EVENT_KEYS: Mapping[Event, EventKey] = {
    key.event: key for key in vars(On).values() if isinstance(key, EventKey)
}
"""Each event's key in the table above."""

CONTEXT_TYPES: Mapping[Event, type[object]] = {
    event: key.context_type for event, key in EVENT_KEYS.items()
}
"""Each event's context type, from the table above."""

FIT_EVENTS: frozenset[Event] = frozenset(
    {Event.SETUP, Event.FIT_START, Event.FIT_END, Event.EXCEPTION, Event.TEARDOWN}
)
"""Events of the fit around the steps (once per fit)."""

STEP_EVENTS: frozenset[Event] = frozenset(Event) - FIT_EVENTS
"""Events inside a global step; their contexts carry the step number (filters apply)."""

assert set(EVENT_KEYS) == set(Event), "every Event needs a row in the table On"


#: Events emitted once per microbatch, K times per global step.
_MICROBATCH_EVENTS: tuple[Event, ...] = (
    Event.MICROBATCH_START,
    Event.BEFORE_BACKWARD,
    Event.AFTER_BACKWARD,
    Event.MICROBATCH_END,
)

#: Events emitted once per global step after the K microbatches, in order.
#: ``OPTIMIZER_RESET`` is emitted only when a callback asked for a reset at
#: ``COORDINATE`` and resets are enabled; ``EVAL_START``/``EVAL_END`` only on evaluation
#: steps (every ``eval_every`` steps and the final step, when evaluation is on).
STEP_TAIL_EVENTS: tuple[Event, ...] = (
    Event.BEFORE_OPTIMIZER_STEP,
    Event.AFTER_OPTIMIZER_STEP,
    Event.AFTER_SCHEDULER_STEP,
    Event.COORDINATE,
    Event.OPTIMIZER_RESET,
    Event.EVAL_START,
    Event.EVAL_END,
    Event.METRICS,
    Event.CHECKPOINT,
    Event.STEP_END,
)

_EVAL_EVENTS: tuple[Event, ...] = (Event.EVAL_START, Event.EVAL_END)
"""Events emitted only on evaluation steps, in order."""


def expected_step_trace(
    accumulation_steps: int, *, optimizer_reset: bool = False, evaluation: bool = False
) -> list[Event]:
    """The exact event sequence of one global step with K = ``accumulation_steps``
    (``evaluation``: the step evaluates the held-out set)."""
    trace = [Event.STEP_START]
    trace += list(_MICROBATCH_EVENTS) * accumulation_steps
    for event in STEP_TAIL_EVENTS:
        if event is Event.OPTIMIZER_RESET and not optimizer_reset:
            continue
        if event in _EVAL_EVENTS and not evaluation:
            continue
        trace.append(event)
    return trace
