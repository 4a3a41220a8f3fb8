"""The callback that runs a ``StageStreamScheduler`` (out-of-order backprop,
``speedtronic.systems.stage_streams``) around every microbatch's forward pass."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import (
    BackwardContext,
    FitContext,
    MicrobatchContext,
    TeardownContext,
)

if TYPE_CHECKING:
    from speedtronic.engine.view import TrainerView
    from speedtronic.systems.stage_streams import StageStreamScheduler

__all__ = ["StageStreamCallback"]

_LOGGER = logging.getLogger("speedtronic.stage_streams")


class StageStreamCallback(Callback):
    """Runs a ``StageStreamScheduler`` around every microbatch's forward pass (the runtime
    adds it when ``ooo_backprop: true``): ``begin`` at ``microbatch_start``, ``finish`` at
    ``before_backward`` (the loss exists, backward follows on the stage streams), ``dispose``
    at ``teardown``. On CPU/MPS the scheduler is disabled and the hooks do nothing."""

    def __init__(self, scheduler: StageStreamScheduler) -> None:
        self.scheduler = scheduler

    def on_setup(self, trainer: TrainerView, ctx: FitContext) -> None:
        if not self.scheduler.enabled and self.scheduler.reason:
            _LOGGER.info("out-of-order backprop disabled: %s", self.scheduler.reason)

    def on_fit_start(self, trainer: TrainerView, ctx: FitContext) -> None:
        trainer.notes.publish("ooo_backprop", self.scheduler.as_dict())  # 2.0's event

    def on_microbatch_start(self, trainer: TrainerView, ctx: MicrobatchContext) -> None:
        self.scheduler.begin()

    def on_before_backward(self, trainer: TrainerView, ctx: BackwardContext) -> None:
        self.scheduler.finish()

    def on_teardown(self, trainer: TrainerView, ctx: TeardownContext) -> None:
        self.scheduler.dispose()
