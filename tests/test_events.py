"""Golden event traces: the exact per-fit and per-step sequence, and dispatch rules."""

from __future__ import annotations

import warnings

import pytest
import torch
from scalar_model import Scalar

from speedtronic import Callback, Event, Trainer
from speedtronic.engine.contexts import CoordinateContext, MetricsContext, StepContext
from speedtronic.engine.dispatch import (
    CallbackPlan,
    CallbackWarning,
    DuplicateStateKeyError,
    overrides,
)
from speedtronic.engine.events import STEP_TAIL_EVENTS, expected_step_trace
from speedtronic.testing import EventRecorder, expected_fit_trace


def batches(n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.ones(2), torch.full((2,), float(i))) for i in range(n)]


class ResetEveryOtherStep(Callback):
    def on_coordinate(self, trainer: Trainer, ctx: CoordinateContext) -> None:
        if ctx.step % 2 == 0:
            trainer.request_optimizer_reset("test")


def make_trainer(k: int, *callbacks: Callback, steps: int = 3) -> Trainer:
    model = Scalar()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return Trainer(
        model,
        opt,
        batches(),
        device="cpu",
        callbacks=list(callbacks),
        max_steps=steps,
        accumulation_steps=k,
    )


def test_golden_trace_k1() -> None:
    recorder = EventRecorder()
    make_trainer(1, recorder).fit()
    assert recorder.events == expected_fit_trace(3, 1)
    # Written out once by hand, so the helper itself is checked too.
    step = [
        Event.STEP_START,
        Event.MICROBATCH_START,
        Event.BEFORE_BACKWARD,
        Event.AFTER_BACKWARD,
        Event.MICROBATCH_END,
        Event.BEFORE_OPTIMIZER_STEP,
        Event.AFTER_OPTIMIZER_STEP,
        Event.AFTER_SCHEDULER_STEP,
        Event.COORDINATE,
        Event.METRICS,
        Event.CHECKPOINT,
        Event.STEP_END,
    ]
    assert recorder.events == [
        Event.SETUP,
        Event.FIT_START,
        *step * 3,
        Event.FIT_END,
        Event.TEARDOWN,
    ]


def test_golden_trace_k3_with_optimizer_reset() -> None:
    recorder = EventRecorder()
    trainer = make_trainer(3, ResetEveryOtherStep(), recorder, steps=4)
    trainer.fit()
    assert recorder.events == expected_fit_trace(4, 3, reset_steps=frozenset({2, 4}))
    counts = recorder.counts()
    assert counts[Event.STEP_START] == 4
    assert counts[Event.MICROBATCH_START] == counts[Event.BEFORE_BACKWARD] == 12
    assert counts[Event.AFTER_BACKWARD] == counts[Event.MICROBATCH_END] == 12
    assert counts[Event.OPTIMIZER_RESET] == 2
    assert counts[Event.METRICS] == counts[Event.CHECKPOINT] == 4
    assert counts[Event.SETUP] == counts[Event.TEARDOWN] == 1
    reset_steps = [e.step for e in recorder.trace if e.event is Event.OPTIMIZER_RESET]
    assert reset_steps == [2, 4]
    indices = [e.index for e in recorder.trace if e.event is Event.MICROBATCH_START and e.step == 1]
    assert indices == [0, 1, 2]
    # The reset really cleared AdamW's state at step 4, the last step.
    assert len(trainer.optimizer.state) == 0


def test_reset_not_emitted_when_disabled() -> None:
    recorder = EventRecorder()
    model = Scalar()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    Trainer(
        model,
        opt,
        batches(),
        callbacks=[ResetEveryOtherStep(), recorder],
        max_steps=2,
        allow_optimizer_reset=False,
    ).fit()
    assert Event.OPTIMIZER_RESET not in recorder.events
    assert len(opt.state) == 1


def test_expected_step_trace_matches_event_list() -> None:
    trace = expected_step_trace(2, optimizer_reset=True, evaluation=True)
    assert trace[0] is Event.STEP_START
    assert trace[-len(STEP_TAIL_EVENTS) :] == list(STEP_TAIL_EVENTS)
    # Without a reset or an evaluation those events are simply left out.
    plain = expected_step_trace(2)
    assert plain[-len(STEP_TAIL_EVENTS) + 3 :] == [
        event
        for event in STEP_TAIL_EVENTS
        if event not in (Event.OPTIMIZER_RESET, Event.EVAL_START, Event.EVAL_END)
    ]


def test_golden_trace_with_evaluation_and_reset() -> None:
    recorder = EventRecorder()
    model = Scalar()
    trainer = Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=0.1),
        batches(),
        callbacks=[ResetEveryOtherStep(), recorder],
        max_steps=3,
        eval_data=batches(2),
        eval_every=2,
    )
    trainer.fit()
    assert recorder.events == expected_fit_trace(
        3, 1, reset_steps=frozenset({2}), eval_steps=frozenset({2, 3})
    )
    step_two = [e.event for e in recorder.trace if e.step == 2]
    assert step_two[-7:] == [
        Event.COORDINATE,
        Event.OPTIMIZER_RESET,
        Event.EVAL_START,
        Event.EVAL_END,
        Event.METRICS,
        Event.CHECKPOINT,
        Event.STEP_END,
    ]


def test_exception_then_teardown() -> None:
    class Boom(Callback):
        def on_step_end(self, trainer: Trainer, ctx: StepContext) -> None:
            raise RuntimeError("model exploded")

    recorder = EventRecorder()
    with pytest.raises(RuntimeError, match="model exploded"):
        make_trainer(1, recorder, Boom()).fit()
    assert recorder.events[-2:] == [Event.EXCEPTION, Event.TEARDOWN]
    assert Event.FIT_END not in recorder.events


def test_dispatch_skips_callbacks_that_do_not_override() -> None:
    class OnlyMetrics(Callback):
        def on_metrics(self, trainer: Trainer, ctx: MetricsContext) -> None:
            pass

    cb = OnlyMetrics()
    plan = CallbackPlan([cb])
    assert overrides(cb, Event.METRICS)
    assert not overrides(cb, Event.STEP_START)
    assert plan.hooks(Event.STEP_START) == ()
    assert len(plan.hooks(Event.METRICS)) == 1


def test_metrics_contributors_run_before_sinks_in_given_order() -> None:
    seen: list[str] = []

    class Sink(Callback):
        metrics_phase = "consume"

        def on_metrics(self, trainer: Trainer, ctx: MetricsContext) -> None:
            seen.append(f"sink:{ctx.record.get('extra')}")

    class Contributor(Callback):
        def on_metrics(self, trainer: Trainer, ctx: MetricsContext) -> None:
            ctx.record.set("extra", 7)
            seen.append("contributor")

    make_trainer(1, Sink(), Contributor(), steps=1).fit()
    assert seen == ["contributor", "sink:7"]


def test_observer_failure_warns_once_and_training_continues() -> None:
    class BrokenSink(Callback):
        is_observer = True
        metrics_phase = "consume"
        calls = 0

        def on_metrics(self, trainer: Trainer, ctx: MetricsContext) -> None:
            BrokenSink.calls += 1
            raise OSError("disk full")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = make_trainer(1, BrokenSink(), steps=4).fit()
    assert result.steps == 4
    assert BrokenSink.calls == 4
    messages = [str(w.message) for w in caught if issubclass(w.category, CallbackWarning)]
    assert len(messages) == 1
    assert "BrokenSink" in messages[0] and "metrics" in messages[0] and "disk full" in messages[0]


def test_duplicate_state_keys_are_rejected() -> None:
    class Stateful(Callback):
        state_key = "same"

    with pytest.raises(DuplicateStateKeyError, match="same"):
        make_trainer(1, Stateful(), Stateful())


def test_request_stop_ends_cleanly() -> None:
    class StopAtTwo(Callback):
        def on_step_end(self, trainer: Trainer, ctx: StepContext) -> None:
            if ctx.step == 2:
                trainer.request_stop("enough")

    recorder = EventRecorder()
    result = make_trainer(1, StopAtTwo(), recorder, steps=10).fit()
    assert result.steps == 2
    assert result.stop_reason == "enough"
    assert recorder.events[-2:] == [Event.FIT_END, Event.TEARDOWN]
