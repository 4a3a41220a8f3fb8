"""Event filters (``due_when``): the plan calls a filtered hook only on its due steps, and the
metric record is not built on steps where no metrics hook is due."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scalar_model import Scalar

from speedtronic import Callback, Event, Trainer
from speedtronic.engine.contexts import FitContext, StepContext
from speedtronic.engine.dispatch import FilterError, describe_classes
from speedtronic.engine.filters import StepFilter, every, final_step, logging_steps, never, once
from speedtronic.engine.metrics import MetricRecord, MetricValue
from speedtronic.engine.view import TrainerView
from speedtronic.testing import EventRecorder


def fit(*callbacks: Callback, steps: int = 5, metrics_every: int = 2, k: int = 1) -> Trainer:
    model = Scalar()
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        [(torch.ones(2), torch.full((2,), float(i))) for i in range(4)],
        callbacks=list(callbacks),
        max_steps=steps,
        metrics_every=metrics_every,
        accumulation_steps=k,
    )
    trainer.fit()
    return trainer


def test_every_n_calls_the_hook_on_multiples_only() -> None:
    filtered = EventRecorder({Event.STEP_END: every(2), Event.AFTER_BACKWARD: every(3)})
    plain = EventRecorder()
    fit(filtered, plain, steps=7, k=2)
    assert filtered.steps_of(Event.STEP_END) == [2, 4, 6]
    assert filtered.steps_of(Event.AFTER_BACKWARD) == [3, 3, 6, 6]  # K=2 microbatches
    assert filtered.steps_of(Event.STEP_START) == [1, 2, 3, 4, 5, 6, 7]  # unfiltered hook
    assert plain.steps_of(Event.STEP_END) == [1, 2, 3, 4, 5, 6, 7]  # others unaffected


def test_once_final_and_logging_steps() -> None:
    recorder = EventRecorder(
        {
            Event.CHECKPOINT: once(3),
            Event.COORDINATE: final_step(),
            Event.METRICS: logging_steps(),
            Event.STEP_START: every(4) | once(1),
        }
    )
    fit(recorder, steps=5, metrics_every=2)
    assert recorder.steps_of(Event.CHECKPOINT) == [3]
    assert recorder.steps_of(Event.COORDINATE) == [5]
    assert recorder.steps_of(Event.METRICS) == [2, 4, 5]  # every 2, and the final step
    assert recorder.steps_of(Event.STEP_START) == [1, 4]
    # fit-level events are never filtered
    assert recorder.events[:2] == [Event.SETUP, Event.FIT_START]
    assert recorder.events[-2:] == [Event.FIT_END, Event.TEARDOWN]


def test_a_filtered_hook_keeps_its_place_in_the_order() -> None:
    calls: list[tuple[str, int]] = []

    class Named(Callback):
        def __init__(self, name: str, when: StepFilter | None) -> None:
            self.name = name
            if when is not None:
                self.due_when = {Event.STEP_END: when}

        def on_step_end(self, trainer: TrainerView, ctx: StepContext) -> None:
            calls.append((self.name, ctx.step))

    fit(Named("a", None), Named("b", every(2)), Named("c", None), steps=2)
    assert calls == [("a", 1), ("c", 1), ("a", 2), ("b", 2), ("c", 2)]


def test_the_record_is_built_only_when_a_metrics_hook_is_due(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[int] = []
    original_init = MetricRecord.__init__

    def counting_init(self: MetricRecord, step: int) -> None:
        built.append(step)
        original_init(self, step)

    monkeypatch.setattr(MetricRecord, "__init__", counting_init)
    original_of = MetricRecord.of  # the loop builds its record in one call

    def counting_of(
        step: int, values: dict[str, MetricValue], tensors: dict[str, torch.Tensor]
    ) -> MetricRecord:
        built.append(step)
        return original_of(step, values, tensors)

    monkeypatch.setattr(MetricRecord, "of", counting_of)
    fit(EventRecorder({Event.METRICS: logging_steps()}), steps=5, metrics_every=100)
    assert built == [5]  # only the final (logging) step
    built.clear()
    fit(EventRecorder(), steps=3, metrics_every=100)
    assert built == [1, 2, 3]  # an unfiltered metrics hook wants every step


def test_filters_on_fit_events_or_missing_hooks_are_errors() -> None:
    class FitFiltered(Callback):
        due_when = {Event.FIT_START: every(2)}

        def on_fit_start(self, trainer: TrainerView, ctx: FitContext) -> None: ...

    class NoHook(Callback):
        due_when = {Event.STEP_END: every(2)}

    with pytest.raises(FilterError, match="fit-level event"):
        fit(FitFiltered())
    with pytest.raises(FilterError, match="on_step_end"):
        fit(NoHook())


def test_step_filter_rules() -> None:
    with pytest.raises(ValueError, match="every must be >= 1"):
        every(0)
    with pytest.raises(ValueError, match="one cadence"):
        every(2) | every(3)
    both = every(3) | final_step()
    assert [s for s in range(1, 11) if both.due(s, 10, 1)] == [3, 6, 9, 10]
    assert (every(3) | once(4)).describe() == "every 3 | at 4"


def test_built_in_sinks_and_contributors_are_filtered_to_logging_steps() -> None:
    from speedtronic_callbacks.early_stopping import EarlyStopping
    from speedtronic_callbacks.jsonl import JsonlCallback
    from speedtronic_callbacks.nan_guard import NanGuard

    for callback_type in (JsonlCallback, EarlyStopping):
        assert callback_type.due_when == {Event.METRICS: logging_steps()}
    guard = NanGuard(check_every=4)
    assert guard.due_when[Event.BEFORE_OPTIMIZER_STEP] == every(4)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(
    every_n=st.none() | st.integers(1, 7),
    at=st.frozensets(st.integers(1, 40), max_size=3),
    final=st.booleans(),
    logging=st.booleans(),
    step=st.integers(1, 40),
    target=st.integers(1, 40),
    cadence=st.integers(1, 9),
    eval_every=st.integers(0, 9),
)
def test_next_due_is_the_first_due_step(
    every_n: int | None,
    at: frozenset[int],
    final: bool,
    logging: bool,
    step: int,
    target: int,
    cadence: int,
    eval_every: int,
) -> None:
    # The plan skips filter evaluation until ``next_due``: it must never skip a due step.
    rule = StepFilter(every=every_n, at=at, final=final, logging=logging)
    due_steps = [s for s in range(step, 200) if rule.due(s, target, cadence, eval_every)]
    first = due_steps[0] if due_steps else None
    assert rule.next_due(step, target, cadence, eval_every) == first


def test_quiet_stretches_follow_a_new_target_and_a_step_moved_back() -> None:
    # The plan remembers the steps until the next due one; a second fit with another target,
    # and a trainer moved back to an earlier step (resume), must not reuse a stale stretch.
    recorder = EventRecorder({Event.STEP_END: final_step() | once(2)})
    trainer = fit(recorder, steps=5)
    trainer.fit(9)
    assert recorder.steps_of(Event.STEP_END) == [2, 5, 9]
    trainer.step = 1  # same target as before: only the step moved back
    trainer.fit(9)
    assert recorder.steps_of(Event.STEP_END) == [2, 5, 9, 2, 9]


def test_the_validate_plan_shows_each_hooks_filter() -> None:
    class Every3(Callback):
        due_when = {Event.STEP_END: every(3)}

        def on_step_end(self, trainer: TrainerView, ctx: StepContext) -> None:
            del trainer, ctx

        def on_step_start(self, trainer: TrainerView, ctx: StepContext) -> None:
            del trainer, ctx

    rows = dict(describe_classes([("every3", Every3)]))
    assert rows[Event.STEP_END] == ["every3 [every 3]"]
    assert rows[Event.STEP_START] == ["every3"]  # unfiltered hook: no bracket


def test_a_hook_filtered_to_never_is_not_bound() -> None:
    # never() switches a hook off for one instance: the event has no listener at all, so the
    # loop builds no context (or metric record) for it.
    off = EventRecorder({Event.STEP_END: never()})
    plan = fit(off, steps=3).plan
    assert off.steps_of(Event.STEP_END) == []
    assert off.steps_of(Event.STEP_START) == [1, 2, 3]
    assert not plan.listens(Event.STEP_END)
    assert never().describe() == "never"
