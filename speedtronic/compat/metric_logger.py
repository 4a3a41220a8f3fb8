"""The original observability API: ``MetricLogger``, hooks, and a callback adapter.

``MetricLogger`` writes event lines (text and, optionally, JSONL) and fans each event out to
hooks -- ``(event, payload)`` callables or objects with ``on_event``. Code written for the
original ``Trainer(logger=...)`` keeps working through ``MetricLoggerCallback``, which
turns the trainer's events into the original event names (``train_start``, ``train_step``,
``checkpoint``, ``optimizer_step_skipped``, ``optimizer_reset``, ``train_end``).

New code should prefer the sink callbacks in ``callbacks/`` (console, jsonl, tensorboard,
wandb, ...); this module exists so existing users do not have to change anything.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, ClassVar, Literal, Protocol, TextIO, runtime_checkable

from speedtronic.engine.callback import Callback, RankPolicy
from speedtronic.engine.contexts import (
    ExceptionContext,
    FitContext,
    FitEndContext,
    MetricsContext,
    OptimizerResetContext,
    OptimizerStepContext,
    StepContext,
    TeardownContext,
)
from speedtronic.engine.filters import METRICS_ON_LOGGING_STEPS
from speedtronic.state.append_io import open_to_append
from speedtronic.systems.memory import memory_usage_bytes as memory_usage_bytes

if TYPE_CHECKING:
    from speedtronic.config import ConfigSource
    from speedtronic.engine.notes import Notes
    from speedtronic.engine.view import TrainerView

__all__ = [
    "CallbackList",
    "Hook",
    "HookFunction",
    "Metric",
    "MetricLogger",
    "MetricLoggerCallback",
    "Payload",
    "TrainingHook",
    "build_logger",
    "memory_usage_bytes",
]

Metric = float | int | str | bool | None
"""A scalar payload value."""

Payload = dict[str, object]
"""An event's payload: a fresh dict per hook call, so a hook may keep or change it."""


@runtime_checkable
class TrainingHook(Protocol):
    """An object that receives every event emitted by a ``MetricLogger``."""

    def on_event(self, event: str, payload: Payload) -> None: ...


HookFunction = Callable[[str, Payload], None]
"""A plain ``(event, payload)`` function."""

Hook = TrainingHook | HookFunction
"""What ``MetricLogger(hooks=[...])`` accepts."""


def call_hook(hook: Hook, event: str, payload: Payload) -> None:
    """Deliver one event to a hook object (``on_event``) or function."""
    if isinstance(hook, TrainingHook):
        hook.on_event(event, payload)
    else:
        hook(event, payload)


class CallbackList:
    """Fans ``on_event`` out to several hooks, in order (the original helper)."""

    def __init__(self, callbacks: Iterable[Hook] | None = None) -> None:
        self.callbacks: list[Hook] = list(callbacks or [])

    def append(self, hook: Hook) -> None:
        self.callbacks.append(hook)

    def on_event(self, event: str, payload: Payload) -> None:
        for hook in self.callbacks:
            call_hook(hook, event, dict(payload))

    def __call__(self, event: str, payload: Payload) -> None:
        self.on_event(event, payload)


def _level_number(level: str | int) -> int:
    """A ``logging`` level; unknown names map to INFO (as in the original)."""
    if isinstance(level, int):
        return level
    number = logging.getLevelName(str(level).upper())
    return number if isinstance(number, int) else logging.INFO


def _format_value(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _format_event_line(event: str, payload: Mapping[str, object]) -> str:
    """``<event> key=value key=value ...`` (the message part of a text line)."""
    fields = " ".join(f"{key}={_format_value(value)}" for key, value in payload.items())
    return f"{event} {fields}".rstrip()


@dataclass
class MetricLogger:
    """Event logger of the original API: text lines, optional JSONL, and hooks.

    Text goes to ``stream`` (stdout by default) or, when ``file`` is set, to that file;
    ``json_file`` adds one JSON object per event. ``train_step`` events are dropped unless
    ``step`` is a multiple of ``every_steps``; every other event is always emitted. Hook
    failures are logged as a warning once per hook and event, and never propagate.
    ``hooks`` may be given as ``None``; it is always a list after construction, so
    ``logger.hooks.append(hook)`` works. ``echo=False`` writes no text lines unless ``file``
    is set (the logger ``build_runtime`` attaches as ``trainer.logger``: the sinks already
    print); an event with no output and no hook is dropped at once.
    """

    level: str = "INFO"
    file: str | Path | None = None
    json_file: str | Path | None = None
    every_steps: int = 1
    stream: TextIO | None = None
    hooks: list[Hook] = field(default_factory=list)
    echo: bool = True

    def __post_init__(self) -> None:
        if self.every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {self.every_steps}")
        self.hooks = list(self.hooks or [])
        self._lock = threading.RLock()
        self._start = time.perf_counter()
        self._failed_hooks: set[tuple[int, str]] = set()
        self._json_handle: IO[str] | None = None
        self._closed = False
        self._logger = logging.getLogger(f"speedtronic.metrics.{id(self):x}")
        self._logger.propagate = False
        self._logger.setLevel(_level_number(self.level))
        self._handler = self._make_handler()
        self._logger.addHandler(self._handler)

    def _make_handler(self) -> logging.Handler:
        handler: logging.Handler
        if self.file is None and not self.echo:
            return logging.NullHandler()
        if self.file is not None:
            path = Path(self.file)
            path.parent.mkdir(parents=True, exist_ok=True)
            handler = logging.FileHandler(path, encoding="utf-8")
        else:
            handler = logging.StreamHandler(self.stream or sys.stdout)
        handler.setFormatter(
            logging.Formatter("%(asctime)s | %(levelname)s | %(message)s", "%Y-%m-%d %H:%M:%S")
        )
        return handler

    # -- plain logging ------------------------------------------------------------------

    def log(self, level: int, message: str, *args: object) -> None:
        self._logger.log(level, message, *args)

    def debug(self, message: str, *args: object) -> None:
        self._logger.debug(message, *args)

    def info(self, message: str, *args: object) -> None:
        self._logger.info(message, *args)

    def warning(self, message: str, *args: object) -> None:
        self._logger.warning(message, *args)

    def error(self, message: str, *args: object) -> None:
        self._logger.error(message, *args)

    # -- events -------------------------------------------------------------------------

    def emit(self, event: str, payload: Mapping[str, object] | None = None) -> None:
        """Log ``event`` with ``payload`` (text, JSONL) and hand it to every hook."""
        if not self.hooks and self.json_file is None and self.file is None and not self.echo:
            return  # nobody would see it
        with self._lock:
            self._emit_locked(event, dict(payload or {}))

    def _emit_locked(self, event: str, data: Payload) -> None:
        data.setdefault("elapsed_s", time.perf_counter() - self._start)
        if "memory_bytes" not in data:
            memory = memory_usage_bytes()
            if memory is not None:
                data["memory_bytes"] = memory
        if event == "train_step" and not self._is_due(data.get("step")):
            return
        self._logger.info(_format_event_line(event, data))
        self._write_json(event, data)
        for index, hook in enumerate(list(self.hooks)):
            try:
                call_hook(hook, event, dict(data))
            except Exception as exc:  # a hook must never break training
                self._report_hook_failure(index, hook, event, exc)

    def _is_due(self, step: object) -> bool:
        return not isinstance(step, int) or step % self.every_steps == 0

    def _write_json(self, event: str, data: Payload) -> None:
        if self.json_file is None or self._closed:
            return
        if self._json_handle is None:
            path = Path(self.json_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._json_handle = open_to_append(path)  # never through a planted link
        self._json_handle.write(json.dumps({"event": event, **data}, default=str) + "\n")
        self._json_handle.flush()

    def _report_hook_failure(self, index: int, hook: Hook, event: str, exc: Exception) -> None:
        key = (index, event)
        if key in self._failed_hooks:
            return
        self._failed_hooks.add(key)
        name = getattr(hook, "__qualname__", None) or type(hook).__qualname__
        self._logger.warning(
            "hook %s failed on %s: %s: %s (further failures of it on this event are not logged)",
            name,
            event,
            type(exc).__name__,
            exc,
        )

    def close(self) -> None:
        """Flush and close the text handler and the JSONL file (hooks are not closed)."""
        with self._lock:
            self._closed = True
            self._logger.removeHandler(self._handler)
            self._handler.close()
            handle, self._json_handle = self._json_handle, None
            if handle is not None:
                handle.close()


@runtime_checkable
class ReportsCheckpoints(Protocol):
    """A callback that says which step it saved last and where (the checkpoint callback)."""

    last_saved_step: int | None
    last_path: Path | None


class MetricLoggerCallback(Callback):
    """Feeds a ``MetricLogger`` from the trainer's events, under the original event names.

    ``train_start`` (fit start), ``train_step`` (each due metric record), ``checkpoint``
    (whenever a callback reporting ``last_saved_step``/``last_path`` -- the checkpoint
    callback -- saved), ``optimizer_step_skipped`` (fp16 overflow), ``optimizer_reset``,
    ``train_end`` (fit end) and ``train_error`` (the fit failed). ``close_logger`` closes the
    logger at teardown (off by default: the caller owns it, as in the original).

    The other 2.0 events come as notes (``speedtronic.engine.notes``) and are emitted under their
    names: ``compile`` and ``ooo_backprop`` from the engine, ``outer_step`` and
    ``delta_upload_*`` from the DiLoCo plugin, and -- at the first fit -- ``shape_profile``
    and one ``shape_warning`` per warning of the trainer's startup shape report. ``notes``
    (the trainer's board) subscribes at once; without it the callback subscribes to the
    trainer's board at ``setup``.
    """

    is_observer: ClassVar[bool] = True
    metrics_phase: ClassVar[Literal["contribute", "consume"]] = "consume"
    rank_policy: ClassVar[RankPolicy] = "main"
    due_when = METRICS_ON_LOGGING_STEPS  # on_metrics only on logging steps

    def __init__(
        self, logger: MetricLogger, *, close_logger: bool = False, notes: Notes | None = None
    ) -> None:
        self.logger = logger
        self.close_logger = close_logger
        self._reported_saves: set[tuple[int, str]] = set()
        self._savers: tuple[ReportsCheckpoints, ...] | None = None  # found at fit start
        self._subscribed: Notes | None = None
        self._shapes_reported = False
        if notes is not None:
            self._listen(notes)

    def _listen(self, notes: Notes) -> None:
        if self._subscribed is not notes:
            notes.subscribe(self.logger.emit)
            self._subscribed = notes

    def on_setup(self, trainer: TrainerView, ctx: FitContext) -> None:
        self._listen(trainer.notes)

    @property
    def display_name(self) -> str:
        return "metric_logger"

    def on_fit_start(self, trainer: TrainerView, ctx: FitContext) -> None:
        self._find_savers(trainer)
        self.logger.emit(
            "train_start",
            {
                "start_step": ctx.start_step,
                "target_step": ctx.target_step,
                "device": str(trainer.device),
                "precision": trainer.precision_mode,
                "accumulation_steps": trainer.accumulation_steps,
                "parameters": sum(p.numel() for p in trainer.model.parameters()),
            },
        )
        if not self._shapes_reported:
            self._shapes_reported = True
            self._emit_shape_report(_shape_report_of(trainer))

    def _emit_shape_report(self, report: object) -> None:
        """2.0's ``shape_profile`` and ``shape_warning`` events, from the report the
        runtime made at start-up."""
        from dataclasses import asdict

        from speedtronic.systems.shapes import ShapeReport

        if not isinstance(report, ShapeReport):
            return
        self.logger.emit("shape_profile", report.as_dict())
        for warning in report.warnings:
            self.logger.emit("shape_warning", asdict(warning))

    def on_after_optimizer_step(self, trainer: TrainerView, ctx: OptimizerStepContext) -> None:
        if ctx.skipped:
            self.logger.emit("optimizer_step_skipped", {"step": ctx.step})

    def on_optimizer_reset(self, trainer: TrainerView, ctx: OptimizerResetContext) -> None:
        self.logger.emit(
            "optimizer_reset", {"step": ctx.step, "requested_by": ",".join(ctx.requested_by)}
        )

    def on_metrics(self, trainer: TrainerView, ctx: MetricsContext) -> None:
        self.logger.emit("train_step", ctx.record.values())

    def on_step_end(self, trainer: TrainerView, ctx: StepContext) -> None:
        self._emit_new_saves(trainer)

    def on_fit_end(self, trainer: TrainerView, ctx: FitEndContext) -> None:
        result = ctx.result
        payload: Payload = {
            "steps": result.steps,
            "elapsed_s": result.elapsed_s,
            "loss": result.final_loss,
        }
        if ctx.stop_reason is not None:
            payload["stop_reason"] = ctx.stop_reason
        self.logger.emit("train_end", payload)

    def on_exception(self, trainer: TrainerView, ctx: ExceptionContext) -> None:
        error = ctx.error
        self.logger.emit(
            "train_error", {"step": ctx.step, "error": f"{type(error).__name__}: {error}"}
        )

    def on_teardown(self, trainer: TrainerView, ctx: TeardownContext) -> None:
        try:
            self._emit_new_saves(trainer)  # the final save happens at fit_end
        finally:
            if self.close_logger:
                self.logger.close()

    def _find_savers(self, trainer: TrainerView) -> None:
        """The callbacks that report their saves; the saves made so far are not news. Found
        once per fit (a per-step isinstance() against a Protocol is not free), or when the
        callback joins a fit already running (a runtime-built trainer's logger read then)."""
        self._savers = tuple(
            cb for cb in _callbacks_of(trainer) if isinstance(cb, ReportsCheckpoints)
        )
        self._reported_saves = self._saves()

    def _saves(self) -> set[tuple[int, str]]:
        saves = set()
        for saver in self._savers or ():
            step, path = saver.last_saved_step, saver.last_path
            if step is not None and path is not None:
                saves.add((step, str(path)))
        return saves

    def _emit_new_saves(self, trainer: TrainerView) -> None:
        if self._savers is None:
            self._find_savers(trainer)
        for step, path in sorted(self._saves() - self._reported_saves):
            self._reported_saves.add((step, path))
            self.logger.emit("checkpoint", {"step": step, "path": path})


def _shape_report_of(trainer: TrainerView) -> object:
    """The startup shape report the runtime gave the trainer (``None`` without one): the
    Trainer's ``shape_report``, read by name (the view does not declare it)."""
    report: object = getattr(trainer, "shape_report", None)
    return report


def _callbacks_of(trainer: TrainerView) -> Sequence[Callback]:
    """The callbacks of the run: the 2.0 logger reports the checkpoint callback's saves.
    A shim of the original API may know the concrete trainer; plugins may not."""
    from speedtronic.engine.trainer import Trainer

    return trainer.callbacks if isinstance(trainer, Trainer) else ()


def build_logger(config: ConfigSource, *, outputs: bool = True) -> MetricLogger:
    """2.0's ``build_logger`` (``speedtronic.runtime.build_logger``): a ``MetricLogger`` with
    ``logging.level``, ``logging.file``, ``logging.json_file`` and ``logging.every_steps``
    (paths relative to the working directory, as in 2.0), and no hooks.

    A trainer holding a run config (the runtime's) offers one as ``trainer.logger`` (built at
    the first read, ``speedtronic.compat.trainer``) so that 2.0 code can append hooks
    (``trainer.logger.hooks.append(hook)``). That one is built with ``outputs=False``: the
    console and ``jsonl`` sinks already print the metrics and write ``logging.file`` and
    ``logging.json_file``, so it only feeds its hooks.
    """
    from speedtronic.config import SpeedtronicConfig

    cfg = (
        config.ensure_valid()
        if isinstance(config, SpeedtronicConfig)
        else SpeedtronicConfig.load(config)
    )
    section = cfg.logging
    json_file = section.extensions.get("json_file")
    return MetricLogger(
        level=section.level,
        file=section.file if outputs else None,
        json_file=json_file if outputs and isinstance(json_file, str) else None,
        every_steps=section.every_steps,
        echo=outputs,
    )
