"""EarlyStopping and the NaN guard end runs cleanly: final checkpoint written, sinks closed."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
from sink_helpers import make_batches, make_trainer, read_jsonl

from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import MetricsContext
from speedtronic.engine.trainer import Trainer
from speedtronic_callbacks.checkpoint import CheckpointCallback
from speedtronic_callbacks.console import ConsoleCallback
from speedtronic_callbacks.csv_sink import CsvCallback
from speedtronic_callbacks.early_stopping import EarlyStopping, MonitorError
from speedtronic_callbacks.jsonl import JsonlCallback
from speedtronic_callbacks.nan_guard import SKIPPED_KEY, NanGuard, NonFiniteLossError
from speedtronic_callbacks.sink import MetricSink
from speedtronic_callbacks.tensorboard import TensorBoardCallback


def open_sinks(tmp_path: Path) -> list[MetricSink]:
    return [
        ConsoleCallback(file=tmp_path / "log.txt"),
        JsonlCallback(),
        CsvCallback(),
        TensorBoardCallback(),
    ]


def finite_weights(trainer: Trainer) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())


class ScriptedMetric(Callback):
    """Contributes ``score`` from a fixed script, one value per due record."""

    def __init__(self, values: list[float]) -> None:
        self.values = values

    def on_metrics(self, trainer: Trainer, ctx: MetricsContext) -> None:
        if ctx.due:
            ctx.record.set("score", self.values[ctx.step - 1])


# -- early stopping ---------------------------------------------------------------------


def test_early_stopping_stops_cleanly_with_a_final_checkpoint(tmp_path: Path) -> None:
    sinks = open_sinks(tmp_path)
    saver = CheckpointCallback(tmp_path / "ckpt", every_steps=100, save_on_signal=False)
    stopper = EarlyStopping("score", mode="min", patience=2)
    scores = [5.0, 4.0, 4.5, 4.2, 1.0, 0.5, 0.1, 0.0]
    trainer = make_trainer(tmp_path, [ScriptedMetric(scores), stopper, saver, *sinks], max_steps=8)
    result = trainer.fit()
    assert result.steps == 4
    assert result.stop_reason is not None
    assert result.stop_reason.startswith("early_stopping: score did not improve for 2 checks")
    assert "best 4 at step 2" in result.stop_reason
    assert stopper.stopped_step == 4
    assert saver.last_saved_step == 4 and (tmp_path / "ckpt").is_dir()
    assert all(sink.closed for sink in sinks)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    last_line = (tmp_path / "log.txt").read_text(encoding="utf-8").splitlines()[-1]
    assert last_line.startswith("fit end: 4 steps") and "stopped: early_stopping" in last_line


def test_early_stopping_mode_max_and_min_delta() -> None:
    stopper = EarlyStopping("acc", mode="max", patience=2, min_delta=0.1)
    assert stopper._update(0.5, 1) is None
    assert stopper._update(0.55, 2) is None  # within min_delta: not an improvement
    assert stopper.wait == 1
    assert stopper._update(0.7, 3) is None
    assert stopper.wait == 0 and stopper.best == 0.7
    assert stopper._update(0.6, 4) is None
    assert stopper._update(0.79, 5) is not None


def test_early_stopping_state_round_trips() -> None:
    stopper = EarlyStopping(patience=5)
    stopper._update(2.0, 1)
    stopper._update(3.0, 2)
    restored = EarlyStopping(patience=5)
    restored.load_state_dict(stopper.state_dict())
    assert (restored.best, restored.wait, restored.best_step) == (2.0, 1, 1)


def test_early_stopping_stops_on_a_non_finite_metric(tmp_path: Path) -> None:
    scores = [3.0, 2.0, math.nan, 1.0]
    trainer = make_trainer(
        tmp_path, [ScriptedMetric(scores), EarlyStopping("score", patience=10)], max_steps=4
    )
    result = trainer.fit()
    assert result.steps == 3 and result.stop_reason == "early_stopping: score is nan at step 3"


def test_a_missing_monitor_fails_the_fit_naming_the_keys(tmp_path: Path) -> None:
    sinks = open_sinks(tmp_path)
    trainer = make_trainer(tmp_path, [EarlyStopping("val_loss"), *sinks], max_steps=3)
    with pytest.raises(MonitorError, match="'val_loss'.*keys: .*loss"):
        trainer.fit()
    assert all(sink.closed for sink in sinks)


# -- NaN guard --------------------------------------------------------------------------


def test_nan_guard_stop_ends_cleanly_without_applying_the_bad_update(tmp_path: Path) -> None:
    sinks = open_sinks(tmp_path)
    saver = CheckpointCallback(tmp_path / "ckpt", every_steps=100, save_on_signal=False)
    guard = NanGuard("stop")
    trainer = make_trainer(
        tmp_path, [guard, saver, *sinks], max_steps=6, batches=make_batches(nan_at=2)
    )
    with pytest.warns(RuntimeWarning, match="nan_guard: loss is nan and gradient norm is nan"):
        result = trainer.fit()
    assert result.steps == 3
    assert result.stop_reason is not None
    assert result.stop_reason.startswith("nan_guard: loss is nan and gradient norm is nan")
    assert "at step 3" in result.stop_reason
    assert finite_weights(trainer)  # the poisoned update never landed
    assert saver.last_saved_step == 3
    assert all(sink.closed for sink in sinks)


def test_nan_guard_raise_fails_naming_the_step_and_closes_sinks(tmp_path: Path) -> None:
    sinks = open_sinks(tmp_path)
    guard = NanGuard("raise")
    trainer = make_trainer(tmp_path, [guard, *sinks], max_steps=6, batches=make_batches(nan_at=1))
    with pytest.raises(NonFiniteLossError, match="loss is nan.* at step 2"):
        trainer.fit()
    assert isinstance(NonFiniteLossError("x"), FloatingPointError)
    assert all(sink.closed for sink in sinks)
    assert finite_weights(trainer)


def test_nan_guard_skip_drops_the_update_and_reports_it(tmp_path: Path) -> None:
    sinks = open_sinks(tmp_path)
    guard = NanGuard("skip")
    trainer = make_trainer(
        tmp_path, [guard, *sinks], max_steps=6, batches=make_batches(count=4, nan_at=1)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = trainer.fit()
    skipped = [str(w.message) for w in caught if "update skipped" in str(w.message)]
    assert skipped == [
        "nan_guard: loss is nan and gradient norm is nan at step 2; update skipped "
        "(1 skipped so far)",
        "nan_guard: loss is nan and gradient norm is nan at step 6; update skipped "
        "(2 skipped so far)",
    ]
    assert result.steps == 6 and result.stop_reason is None
    assert finite_weights(trainer)
    assert [r[SKIPPED_KEY] for r in result.metrics] == [0, 1, 1, 1, 1, 2]
    assert guard.state_dict() == {"skipped_steps": 2}
    assert all(sink.closed for sink in sinks)


def test_nan_guard_skip_stops_after_too_many_bad_steps_in_a_row(tmp_path: Path) -> None:
    guard = NanGuard("skip", max_consecutive_skips=2)
    all_bad = [(torch.full((2, 4), math.nan), torch.zeros(2, 1))]
    trainer = make_trainer(tmp_path, [guard], max_steps=6, batches=all_bad)
    with pytest.warns(RuntimeWarning):
        result = trainer.fit()
    assert result.steps == 2
    assert result.stop_reason is not None and "2 non-finite steps in a row" in result.stop_reason
    assert finite_weights(trainer)


def test_nan_guard_check_every_only_syncs_on_checked_steps(tmp_path: Path) -> None:
    guard = NanGuard("stop", check_every=2)
    trainer = make_trainer(tmp_path, [guard], max_steps=6, batches=make_batches(nan_at=2))
    with pytest.warns(RuntimeWarning, match="at step 4"):
        result = trainer.fit()
    # Step 3 was not checked: its NaN update landed; step 4 found the damage and stopped.
    assert result.steps == 4
    assert not finite_weights(trainer)
