"""The one event table (``speedtronic.engine.events.On``): every event has its context type there,
the hooks are typed to match, the engine's emits are type-checked against it, and an
``on_*`` method that is no event's hook is an error when the trainer is built."""

from __future__ import annotations

import inspect
import re
import typing

import pytest
import torch
from mypy_outside import MypyRun, register
from torch import nn

from speedtronic import Callback, Event, Trainer
from speedtronic.engine import contexts, loop
from speedtronic.engine.contexts import StepContext
from speedtronic.engine.dispatch import CallbackPlan, UnknownHookError, describe_classes
from speedtronic.engine.events import CONTEXT_TYPES, EVENT_KEYS, On
from speedtronic.engine.view import TrainerView


def test_every_event_has_exactly_one_row() -> None:
    rows = [key for key in vars(On).values() if hasattr(key, "context_type")]
    assert [key.event for key in rows] == list(Event)  # in emission order, none missing
    assert set(EVENT_KEYS) == set(Event)


@pytest.mark.parametrize("event", list(Event), ids=lambda e: e.value)
def test_callback_hooks_are_typed_by_the_table(event: Event) -> None:
    parameters = inspect.signature(getattr(Callback, event.hook_name)).parameters
    assert parameters["ctx"].annotation == CONTEXT_TYPES[event].__name__
    assert parameters["trainer"].annotation == "TrainerView"


class Typo(Callback):
    def on_step_ended(self, trainer: TrainerView, ctx: StepContext) -> None:
        raise AssertionError("never called")


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.linear(x), y)


def tiny_trainer(*callbacks: Callback) -> Trainer:
    model = Regression()
    data = [(torch.ones(2), torch.ones(1))]
    return Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        callbacks=list(callbacks),
        max_steps=1,
    )


def test_a_typod_hook_is_an_error_naming_the_nearest_event() -> None:
    with pytest.raises(UnknownHookError, match="'on_step_ended'.*did you mean 'on_step_end'"):
        tiny_trainer(Typo())
    with pytest.raises(UnknownHookError, match="on_step_ended"):
        CallbackPlan([Typo()])
    with pytest.raises(UnknownHookError, match="did you mean 'on_step_end'"):
        describe_classes([("typo", Typo)])


def test_an_inherited_typo_is_found_and_helpers_without_on_are_fine() -> None:
    class Child(Typo):
        def step_helper(self) -> None: ...

    class Fine(Callback):
        on_label = "not a method"

        def helper(self) -> None: ...

    with pytest.raises(UnknownHookError, match="on_step_ended"):
        CallbackPlan([Child()])
    CallbackPlan([Fine()])
    tiny_trainer(Fine()).fit()


WRONG_EMIT = (
    "from speedtronic.engine.contexts import FitContext, StepContext, new_context\n"
    "from speedtronic.engine.dispatch import CallbackPlan\n"
    "from speedtronic.engine.events import On\n"
    "from speedtronic.engine.view import TrainerView\n\n"
    "def emit_all(plan: CallbackPlan, trainer: TrainerView) -> None:\n"
    "    plan.emit(trainer, On.STEP_END, StepContext(1, 1))\n"
    "    plan.emit(trainer, On.STEP_END, FitContext(0, 1))\n"
    "    for hook in plan.begin_step(1, 2, 1)[On.STEP_END]:\n"  # how the loop calls hooks
    "        hook(trainer, StepContext(1, 1))\n"
    "        hook(trainer, FitContext(0, 1))\n"
    "        hook(trainer, new_context(StepContext, (1, 1)))\n"  # how the loop builds them
    "        hook(trainer, new_context(StepContext, (1, 'one')))\n"
)
register("wrong_emit.py", lambda: WRONG_EMIT)


def test_mypy_rejects_a_wrong_context_for_an_event(mypy_outside: MypyRun) -> None:
    """Both ways the engine calls hooks are checked: ``plan.emit`` and the loop's own
    calls through the due-hook table (``HookTable``)."""
    assert mypy_outside.returncode == 1, mypy_outside.stdout
    errors = [line for line in mypy_outside.lines("wrong_emit.py") if ": error:" in line]
    assert len(errors) == 3, mypy_outside.stdout
    # mypy words it "Cannot infer value of type parameter CtxT" or names FitContext.
    assert "wrong_emit.py:8:" in errors[0], errors
    assert "CtxT" in errors[0] or '"FitContext"' in errors[0], errors
    assert "wrong_emit.py:11:" in errors[1] and '"FitContext"' in errors[1], errors
    # The loop's fast constructor checks the fields against the context's own.
    assert "wrong_emit.py:13:" in errors[2] and '"tuple[int, int]"' in errors[2], errors


def test_new_context_overloads_match_the_named_tuples() -> None:
    """``new_context`` (the loop's C-speed constructor) declares each context's fields by
    hand; they must be the named tuple's fields, in order, or mypy would check the wrong
    thing."""
    overloads = typing.get_overloads(contexts.NewContext.__call__)
    assert overloads, "NewContext declares no overloads"
    covered = set()
    for declared in overloads:
        hints = typing.get_type_hints(declared, vars(contexts))
        (cls,) = typing.get_args(hints["cls"])
        fields = typing.get_type_hints(cls)
        assert list(fields) == list(cls._fields), cls
        assert hints["fields"] == tuple[tuple(fields.values())], cls
        assert hints["return"] is cls
        covered.add(cls)
    # Every context the loop builds per step has an overload.
    loop_source = inspect.getsource(loop)
    built = {
        getattr(contexts, name)
        for name in re.findall(r"new_context\((\w+),", loop_source)
    }
    assert built and built <= covered
    assert contexts.new_context(StepContext, (3, 2)) == StepContext(3, 2)
    assert type(contexts.new_context(StepContext, (3, 2))) is StepContext
