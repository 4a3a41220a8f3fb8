"""A deliberately wrong callback: mypy --strict must reject it (see tests)."""

from __future__ import annotations

from speedtronic import Callback
from speedtronic.engine.view import TrainerView


class WrongSignature(Callback):
    # ``on_step_end`` takes (trainer, ctx: StepContext); an int is not a StepContext.
    def on_step_end(self, trainer: TrainerView, ctx: int) -> None:
        print(ctx + 1)
