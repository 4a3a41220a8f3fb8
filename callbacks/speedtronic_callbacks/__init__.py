"""The built-in callbacks, one feature per module (``speedtronic_callbacks.checkpoint``, ...).

Each is a ``speedtronic.engine.callback.Callback`` plugin found through the
``speedtronic.callbacks`` entry-point group, exactly like a third-party plugin. The import
name is ``speedtronic_callbacks``, not ``callbacks``, so that a project's own
``callbacks.py`` never shadows it (see docs/callbacks.md).

The classes below are also importable from here (``from speedtronic_callbacks import
ConsoleCallback``); they load on first use, so importing this package costs nothing and a
run loads only the features its config names.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from speedtronic.user_warnings import skip_frames_under

# The built-ins' warnings are reported at the user's line that led to them, not in here.
skip_frames_under(Path(__file__).parent)

_EXPORTS: dict[str, str] = {
    "CheckpointCallback": "speedtronic_callbacks.checkpoint",
    "ConsoleCallback": "speedtronic_callbacks.console",
    "CsvCallback": "speedtronic_callbacks.csv_sink",
    "DiLoCoCallback": "speedtronic_callbacks.diloco",
    "EMA": "speedtronic_callbacks.ema",
    "EarlyStopping": "speedtronic_callbacks.early_stopping",
    "GradientCheckpointing": "speedtronic_callbacks.gradient_checkpointing",
    "JsonlCallback": "speedtronic_callbacks.jsonl",
    "MetricSink": "speedtronic_callbacks.sink",
    "NanGuard": "speedtronic_callbacks.nan_guard",
    "Profiler": "speedtronic_callbacks.profiler",
    "ProgressBarCallback": "speedtronic_callbacks.progress",
    "SystemMetricsCallback": "speedtronic_callbacks.system_metrics",
    "TensorBoardCallback": "speedtronic_callbacks.tensorboard",
    "TimeBudget": "speedtronic_callbacks.time_budget",
    "WandbCallback": "speedtronic_callbacks.wandb",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'speedtronic_callbacks' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from speedtronic_callbacks.checkpoint import CheckpointCallback as CheckpointCallback
    from speedtronic_callbacks.console import ConsoleCallback as ConsoleCallback
    from speedtronic_callbacks.csv_sink import CsvCallback as CsvCallback
    from speedtronic_callbacks.diloco import DiLoCoCallback as DiLoCoCallback
    from speedtronic_callbacks.early_stopping import EarlyStopping as EarlyStopping
    from speedtronic_callbacks.ema import EMA as EMA
    from speedtronic_callbacks.gradient_checkpointing import (
        GradientCheckpointing as GradientCheckpointing,
    )
    from speedtronic_callbacks.jsonl import JsonlCallback as JsonlCallback
    from speedtronic_callbacks.nan_guard import NanGuard as NanGuard
    from speedtronic_callbacks.profiler import Profiler as Profiler
    from speedtronic_callbacks.progress import ProgressBarCallback as ProgressBarCallback
    from speedtronic_callbacks.sink import MetricSink as MetricSink
    from speedtronic_callbacks.system_metrics import (
        SystemMetricsCallback as SystemMetricsCallback,
    )
    from speedtronic_callbacks.tensorboard import TensorBoardCallback as TensorBoardCallback
    from speedtronic_callbacks.time_budget import TimeBudget as TimeBudget
    from speedtronic_callbacks.wandb import WandbCallback as WandbCallback
