"""Warnings raised for the user name the user's line (``speedtronic.user_warnings``): a
failing observer at the line of its hook that raised, a built-in's warning at the line that
started the fit -- never a line inside the framework."""

from __future__ import annotations

import inspect
import sys
import warnings
from pathlib import Path

import pytest
from sink_helpers import make_trainer

from speedtronic import user_warnings
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import MetricsContext
from speedtronic.engine.dispatch import CallbackWarning
from speedtronic.engine.view import TrainerView
from speedtronic_callbacks.jsonl import JsonlCallback


class FailingObserver(Callback):
    is_observer = True

    def on_metrics(self, trainer: TrainerView, ctx: MetricsContext) -> None:
        raise ValueError("no such key")  # the line the warning names


def line_of(text: str, function: object) -> int:
    lines, first = inspect.getsourcelines(function)  # type: ignore[arg-type]  # a function
    return first + next(i for i, line in enumerate(lines) if text in line)


def fit_and_catch(
    trainer_callbacks: list[Callback], tmp_path: Path
) -> tuple[list[warnings.WarningMessage], int]:
    trainer = make_trainer(tmp_path, trainer_callbacks, max_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]  # CPython
        trainer.fit()
    return caught, fit_line


def test_a_failing_user_observer_is_reported_at_its_raising_line(tmp_path: Path) -> None:
    caught, _ = fit_and_catch([FailingObserver()], tmp_path)
    (report,) = [w for w in caught if issubclass(w.category, CallbackWarning)]
    assert "no such key" in str(report.message)
    assert (report.filename, report.lineno) == (
        __file__,
        line_of('raise ValueError("no such key")', FailingObserver.on_metrics),
    )


def test_a_builtin_callbacks_warning_is_reported_where_the_fit_was_started(
    tmp_path: Path,
) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n', encoding="utf-8")
    caught, fit_line = fit_and_catch([JsonlCallback()], tmp_path)
    (kept,) = [w for w in caught if "held an earlier run's records" in str(w.message)]
    assert (kept.filename, kept.lineno) == (__file__, fit_line)


def test_a_plugin_package_can_have_its_frames_skipped_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "warning_plugin"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from speedtronic.user_warnings import warn\n"
        "def check(value: int) -> None:\n"
        "    if value < 0:\n"
        "        warn(f'{value} is negative')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(user_warnings, "_SKIPPED", list(user_warnings._SKIPPED))
    monkeypatch.delitem(sys.modules, "warning_plugin", raising=False)
    import warning_plugin  # type: ignore[import-not-found]  # written above

    user_warnings.skip_frames_under(package)
    with pytest.warns(UserWarning, match="-1 is negative") as caught:
        warning_plugin.check(-1)
    assert caught[0].filename == __file__
