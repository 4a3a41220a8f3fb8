"""Test utilities for users and for our own suite: record the event trace of a fit.

recorder = EventRecorder()
Trainer(..., callbacks=[recorder]).fit(2)
assert recorder.events[:2] == [Event.SETUP, Event.FIT_START]
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from speedtronic.engine.callback import Callback
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
from speedtronic.engine.events import Event, expected_step_trace
from speedtronic.engine.filters import StepFilter

if TYPE_CHECKING:
    from speedtronic.engine.view import TrainerView

__all__ = ["EventRecorder", "TraceEntry", "expected_fit_trace", "expected_step_trace"]


@dataclass(frozen=True)
class TraceEntry:
    """One recorded event: its step (``None`` for fit-level events) and microbatch index."""

    event: Event
    step: int | None = None
    index: int | None = None


class EventRecorder(Callback):
    """A callback that listens to every event and keeps the trace in order.

    ``due_when`` (optional) filters its per-step hooks like any callback's
    (``speedtronic.engine.filters``), so a test can assert on which steps a filtered hook ran."""

    is_observer = False  # a recorder that fails should fail the test

    def __init__(self, due_when: Mapping[Event, StepFilter] | None = None) -> None:
        self.trace: list[TraceEntry] = []
        if due_when is not None:
            self.due_when = dict(due_when)

    def steps_of(self, event: Event) -> list[int | None]:
        """The steps at which ``event`` was recorded, in order."""
        return [entry.step for entry in self.trace if entry.event is event]

    @property
    def events(self) -> list[Event]:
        return [entry.event for entry in self.trace]

    def counts(self) -> Counter[Event]:
        return Counter(self.events)

    def clear(self) -> None:
        self.trace.clear()

    def _add(self, event: Event, step: int | None = None, index: int | None = None) -> None:
        self.trace.append(TraceEntry(event, step, index))

    def on_setup(self, trainer: TrainerView, ctx: FitContext) -> None:
        self._add(Event.SETUP)

    def on_fit_start(self, trainer: TrainerView, ctx: FitContext) -> None:
        self._add(Event.FIT_START)

    def on_fit_end(self, trainer: TrainerView, ctx: FitEndContext) -> None:
        self._add(Event.FIT_END)

    def on_exception(self, trainer: TrainerView, ctx: ExceptionContext) -> None:
        self._add(Event.EXCEPTION, ctx.step)

    def on_teardown(self, trainer: TrainerView, ctx: TeardownContext) -> None:
        self._add(Event.TEARDOWN)

    def on_step_start(self, trainer: TrainerView, ctx: StepContext) -> None:
        self._add(Event.STEP_START, ctx.step)

    def on_microbatch_start(self, trainer: TrainerView, ctx: MicrobatchContext) -> None:
        self._add(Event.MICROBATCH_START, ctx.step, ctx.index)

    def on_before_backward(self, trainer: TrainerView, ctx: BackwardContext) -> None:
        self._add(Event.BEFORE_BACKWARD, ctx.step, ctx.index)

    def on_after_backward(self, trainer: TrainerView, ctx: BackwardContext) -> None:
        self._add(Event.AFTER_BACKWARD, ctx.step, ctx.index)

    def on_microbatch_end(self, trainer: TrainerView, ctx: MicrobatchContext) -> None:
        self._add(Event.MICROBATCH_END, ctx.step, ctx.index)

    def on_before_optimizer_step(self, trainer: TrainerView, ctx: OptimizerStepContext) -> None:
        self._add(Event.BEFORE_OPTIMIZER_STEP, ctx.step)

    def on_after_optimizer_step(self, trainer: TrainerView, ctx: OptimizerStepContext) -> None:
        self._add(Event.AFTER_OPTIMIZER_STEP, ctx.step)

    def on_after_scheduler_step(self, trainer: TrainerView, ctx: SchedulerContext) -> None:
        self._add(Event.AFTER_SCHEDULER_STEP, ctx.step)

    def on_coordinate(self, trainer: TrainerView, ctx: CoordinateContext) -> None:
        self._add(Event.COORDINATE, ctx.step)

    def on_optimizer_reset(self, trainer: TrainerView, ctx: OptimizerResetContext) -> None:
        self._add(Event.OPTIMIZER_RESET, ctx.step)

    def on_eval_start(self, trainer: TrainerView, ctx: EvalStartContext) -> None:
        self._add(Event.EVAL_START, ctx.step)

    def on_eval_end(self, trainer: TrainerView, ctx: EvalEndContext) -> None:
        self._add(Event.EVAL_END, ctx.step)

    def on_metrics(self, trainer: TrainerView, ctx: MetricsContext) -> None:
        self._add(Event.METRICS, ctx.step)

    def on_checkpoint(self, trainer: TrainerView, ctx: CheckpointContext) -> None:
        self._add(Event.CHECKPOINT, ctx.step)

    def on_step_end(self, trainer: TrainerView, ctx: StepContext) -> None:
        self._add(Event.STEP_END, ctx.step)


def expected_fit_trace(
    steps: int,
    accumulation_steps: int,
    *,
    reset_steps: frozenset[int] = frozenset(),
    eval_steps: frozenset[int] = frozenset(),
) -> list[Event]:
    """The exact trace of a successful fit of ``steps`` global steps (``eval_steps``: the
    steps that evaluate the held-out set)."""
    trace = [Event.SETUP, Event.FIT_START]
    for step in range(1, steps + 1):
        trace += expected_step_trace(
            accumulation_steps, optimizer_reset=step in reset_steps, evaluation=step in eval_steps
        )
    return trace + [Event.FIT_END, Event.TEARDOWN]
