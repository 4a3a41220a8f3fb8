"""The original ``SyncCoordinator`` protocol, adapted onto the ``coordinate`` event."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from torch import nn

from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import CoordinateContext, FitContext, TeardownContext

if TYPE_CHECKING:
    from speedtronic.engine.view import TrainerView


@runtime_checkable
class SyncCoordinator(Protocol):
    """A synchroniser called once per global step after the scheduler step.

    ``after_optimizer_step`` returning a truthy value asks for an inner-optimizer reset.
    """

    def start(self) -> None: ...

    def after_optimizer_step(self, model: nn.Module, step: int) -> bool | None: ...

    def stop(self) -> None: ...

    def state_dict(self) -> dict[str, object] | None: ...

    def load_state_dict(self, state: dict[str, object]) -> None: ...


class CoordinatorCallback(Callback):
    """Runs a ``SyncCoordinator`` with its original contract: ``start()`` only when work
    remains, ``after_optimizer_step`` at ``coordinate``, ``stop()`` always at teardown,
    state restored after ``start()``."""

    state_key = "coordinator"

    def __init__(self, coordinator: SyncCoordinator) -> None:
        self.coordinator = coordinator
        self._pending_state: dict[str, object] | None = None
        self._started = False

    def on_fit_start(self, trainer: TrainerView, ctx: FitContext) -> None:
        if ctx.start_step >= ctx.target_step:
            return
        self.coordinator.start()
        self._started = True
        if self._pending_state is not None:
            self.coordinator.load_state_dict(self._pending_state)
            self._pending_state = None

    def on_coordinate(self, trainer: TrainerView, ctx: CoordinateContext) -> None:
        if self.coordinator.after_optimizer_step(trainer.model, ctx.step):
            trainer.request_optimizer_reset(type(self.coordinator).__name__)

    def on_teardown(self, trainer: TrainerView, ctx: TeardownContext) -> None:
        # The original stopped the coordinator in a ``finally`` on every fit.
        self.coordinator.stop()
        self._started = False

    def state_dict(self) -> dict[str, object]:
        return dict(self.coordinator.state_dict() or {})

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        if not state:
            return
        if self._started:
            self.coordinator.load_state_dict(dict(state))
        else:
            self._pending_state = dict(state)
