"""Deliberately wrong callbacks: mypy --strict must reject them (see tests)."""

from __future__ import annotations

from typing_extensions import override

from speedtronic import Callback
from speedtronic.engine.contexts import StepContext
from speedtronic.engine.view import TrainerView


class WrongSignature(Callback):
    # ``on_step_end`` takes (trainer, ctx: StepContext); an int is not a StepContext.
    def on_step_end(self, trainer: TrainerView, ctx: int) -> None:
        print(ctx + 1)


class MisspelledHook(Callback):
    # No event is called ``step_ended``: ``@override`` makes the typo a mypy error.
    @override
    def on_step_ended(self, trainer: TrainerView, ctx: StepContext) -> None:
        print(ctx.step)
