"""Failure isolation: every ``fit_end``/``exception``/``teardown`` hook runs even when another
raises, and the user sees the fit's original error with later failures attached as notes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from scalar_model import Scalar

from speedtronic import Callback, Trainer
from speedtronic.engine.contexts import (
    ExceptionContext,
    FitEndContext,
    StepContext,
    TeardownContext,
)
from speedtronic.engine.view import TrainerView


def make_trainer(*callbacks: Callback, steps: int = 3) -> Trainer:
    model = Scalar()
    return Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        [(torch.ones(2), torch.ones(2))],
        callbacks=list(callbacks),
        max_steps=steps,
    )


class Failing(Callback):
    """Raises ``error`` in the hooks named in ``where``; records every hook it ran."""

    def __init__(self, name: str, where: set[str], log: list[str]) -> None:
        self.name, self.where, self.log = name, where, log

    def _run(self, hook: str) -> None:
        self.log.append(f"{self.name}.{hook}")
        if hook in self.where:
            raise ValueError(f"{self.name} failed in {hook}")

    def on_step_end(self, trainer: TrainerView, ctx: StepContext) -> None:
        if "step_end" in self.where and ctx.step == 2:
            self._run("step_end")

    def on_fit_end(self, trainer: TrainerView, ctx: FitEndContext) -> None:
        self._run("fit_end")

    def on_exception(self, trainer: TrainerView, ctx: ExceptionContext) -> None:
        self._run("exception")

    def on_teardown(self, trainer: TrainerView, ctx: TeardownContext) -> None:
        self._run("teardown")


def test_teardown_failures_never_replace_the_fits_error() -> None:
    log: list[str] = []
    callbacks = [
        Failing("a", {"step_end", "teardown"}, log),
        Failing("b", {"teardown"}, log),
        Failing("c", set(), log),
    ]
    with pytest.raises(ValueError, match="a failed in step_end") as caught:
        make_trainer(*callbacks).fit()
    assert [e for e in log if e.endswith("teardown")] == ["a.teardown", "b.teardown", "c.teardown"]
    notes = getattr(caught.value, "__notes__", [])
    assert any("'Failing'" in n and "a failed in teardown" in n for n in notes), notes
    assert any("b failed in teardown" in n for n in notes), notes


def test_exception_hook_failures_are_attached_and_all_run() -> None:
    log: list[str] = []
    callbacks = [
        Failing("a", {"step_end", "exception"}, log),
        Failing("b", {"exception"}, log),
        Failing("c", set(), log),
    ]
    with pytest.raises(ValueError, match="a failed in step_end") as caught:
        make_trainer(*callbacks).fit()
    assert [e for e in log if e.endswith("exception")] == [
        "a.exception",
        "b.exception",
        "c.exception",
    ]
    assert len(getattr(caught.value, "__notes__", [])) == 2
    assert sum(e.endswith("teardown") for e in log) == 3


def test_a_teardown_failure_after_success_is_raised_after_every_teardown() -> None:
    log: list[str] = []
    callbacks = [Failing("a", {"teardown"}, log), Failing("b", {"teardown"}, log)]
    with pytest.raises(ValueError, match="a failed in teardown") as caught:
        make_trainer(*callbacks).fit()
    assert log[-2:] == ["a.teardown", "b.teardown"]
    notes = getattr(caught.value, "__notes__", [])
    assert len(notes) == 1 and "b failed in teardown" in notes[0]


def test_a_fit_end_failure_does_not_cost_the_final_checkpoint(tmp_path: Path) -> None:
    from speedtronic_callbacks.checkpoint import CheckpointCallback

    log: list[str] = []
    saver = CheckpointCallback(tmp_path / "ckpt", every_steps=100, save_on_signal=False)
    # The failing user callback comes *before* the checkpoint callback.
    with pytest.raises(ValueError, match="user failed in fit_end"):
        make_trainer(Failing("user", {"fit_end"}, log), saver, steps=3).fit()
    assert saver.last_saved_step == 3
    assert saver.manager.newest_step() == 3
    assert log == ["user.fit_end", "user.exception", "user.teardown"]
