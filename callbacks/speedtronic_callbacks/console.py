"""``console``: one readable text line per due metric record.

    fit start: step 0 -> 100 | device cpu | threads 1 (auto) | precision fp32 | ...
      module       type        params  trainable  dtype
      ...
    step 10/100 | loss 3.4512 | lr 3.00e-04 | 12.3 steps/s | 1.2k tok/s | mine/grad_max 0.8100
    fit end: 100 steps in 0:08 | final loss 1.8400 | 12.1 steps/s

A step line shows the standard fields (loss, eval/loss, lr, grad_norm, rates, memory, mfu),
then every other key a callback logged, so a contributor's key appears without configuring
anything (``other_keys: false`` turns that off; ``keys`` puts chosen keys first).

Lines go to stdout (through ``tqdm.write`` so they never tear a progress bar apart) or,
with ``file``, to a text file (appended, line-buffered). A file that cannot be written (a
full disk, ``/dev/full``, a directory in the way) is reported once, naming the path
(``MetricSink.write_failed``); the file's later lines are dropped.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated, Literal

import torch
from tqdm import tqdm

from speedtronic.config.declare import Opt, plugin
from speedtronic.config.system_sections import LoggingConfig
from speedtronic.engine.contexts import ExceptionContext, FitContext, FitEndContext, TeardownContext
from speedtronic.models.summary import format_model_summary, summarize_model
from speedtronic.plugins import PluginOptions, SectionData, Sections, keys_of
from speedtronic.state.append_io import open_to_append
from speedtronic.state.run_lock import RunPaths
from speedtronic_callbacks.sink import (
    MetricSink,
    NumberFormat,
    Record,
    format_bytes,
    format_duration,
    format_float,
    format_si,
    format_value,
    other_keys,
    resolve_path,
    under_output_dir,
)

if TYPE_CHECKING:
    from speedtronic.engine.view import TrainerView

StreamName = Literal["stdout", "stderr"]


def describe_fit_start(trainer: TrainerView, ctx: FitContext) -> str:
    """The start line: where the fit starts and ends, on what (device, CPU threads, and the
    world size and strategy of a distributed run), with what."""
    parameters = sum(p.numel() for p in trainer.model.parameters())
    parts = [
        f"fit start: step {ctx.start_step} -> {ctx.target_step}",
        f"device {trainer.device}",
        _describe_threads(trainer.run_config),
    ]
    distributed = trainer.distributed
    if distributed is not None and distributed.world_size > 1:
        strategy = _strategy(trainer, distributed.world_size)
        parts.append(f"world {distributed.world_size} ({strategy}, {distributed.backend})")
    parts += [
        f"precision {trainer.precision_mode}",
        f"accumulation {trainer.accumulation_steps}",
        f"{format_si(parameters)} parameters",
    ]
    return " | ".join(parts)


def _strategy(trainer: TrainerView, world_size: int) -> str:
    """``ddp`` or ``fsdp`` (``parallel.strategy``), or ``diloco`` with its replica size when
    a synchronous DiLoCo entry splits the world into replicas (read from the run's config,
    which says how it trains)."""
    run_config = trainer.run_config
    parallel = run_config.get("parallel") if run_config is not None else None
    if isinstance(parallel, Mapping):
        sharded = parallel.get("strategy") == "fsdp"
    else:  # a trainer built without a config says itself
        sharded = run_config is None and trainer.sharded_state
    callbacks = run_config.get("callbacks") if run_config is not None else None
    for entry in callbacks if isinstance(callbacks, list) else []:
        if isinstance(entry, Mapping) and entry.get("name") == "diloco":
            if entry.get("mode") == "collective":
                size = entry.get("ranks_per_replica", 1)
                size = size if isinstance(size, int) and size > 0 else 1
                return f"diloco, {world_size // size} replicas"
    return "fsdp" if sharded else "ddp"


def _describe_threads(run_config: Mapping[str, object] | None) -> str:
    """``threads 1 (auto)``: torch's intra-op threads now, and whether ``run.threads`` chose
    them."""
    run = run_config.get("run") if run_config is not None else None
    setting = run.get("threads") if isinstance(run, Mapping) else None
    return f"threads {torch.get_num_threads()}" + (" (auto)" if setting == "auto" else "")


def _describe_model(model: torch.nn.Module) -> list[str]:
    """The model summary table lines (one per top-level module, then the total)."""
    return format_model_summary(summarize_model(model)).splitlines()


# A field shown by a format spec alone is a ``str.format`` method: no Python frame per line.
_STEP_LINE_FIELDS: tuple[NumberFormat, ...] = (
    ("loss", lambda v: f"loss {format_float(v)}"),
    ("eval/loss", lambda v: f"eval/loss {format_float(v)}"),
    ("eval/ppl", lambda v: f"eval/ppl {format_float(v)}"),
    ("lr", "lr {:.2e}".format),
    ("grad_norm", lambda v: f"grad_norm {format_float(v)}"),
    ("steps_per_sec", "{:.1f} steps/s".format),
    ("tokens_per_sec", lambda v: f"{format_si(v)} tok/s"),
    ("memory_bytes", lambda v: f"mem {format_bytes(v)}"),
    ("mfu", lambda v: f"mfu {100 * v:.1f}%"),
)


_STEP_LINE_KEYS = frozenset(key for key, _ in _STEP_LINE_FIELDS) | {"steps_per_sec"}


@functools.lru_cache(maxsize=64)
def _line_plan(
    record_keys: tuple[str, ...], extra_keys: tuple[str, ...], other: bool
) -> tuple[tuple[NumberFormat, ...], tuple[str, ...]]:
    """The standard fields a record with these keys has, and the keys shown after them:
    ``extra_keys``, then (``other``) its other keys (``sink.other_keys``). A run's records
    have the same keys step after step, so the line's layout is worked out once per shape,
    not once per line."""
    present = frozenset(record_keys)
    fields = tuple(field for field in _STEP_LINE_FIELDS if field[0] in present)
    if not other:
        return fields, extra_keys
    return fields, extra_keys + tuple(other_keys(record_keys, _STEP_LINE_KEYS.union(extra_keys)))


def describe_record(
    record: Record,
    target_step: int,
    extra_keys: Sequence[str] = (),
    *,
    other: bool = True,
) -> str:
    """One step line from a finished record: the standard fields, then ``extra_keys``, then
    (``other``) every other key a callback logged (``sink.other_keys``); keys that are
    absent are left out."""
    fields, shown = _line_plan(tuple(record), tuple(extra_keys), other)
    parts = [f"step {record['step']}/{target_step}"]
    for key, show in fields:  # present by the plan; shown when the value is a number
        value = record[key]
        if type(value) is float:  # the usual case: no conversion
            parts.append(show(value))
        elif isinstance(value, (int, float)) and type(value) is not bool:
            parts.append(show(float(value)))
    for key in shown:
        shown_value = record.get(key)
        if shown_value is not None:
            parts.append(f"{key} {format_value(key, shown_value)}")
    return " | ".join(parts)


def _describe_fit_end(ctx: FitEndContext) -> str:
    """The summary line: steps, wall time, final loss, rate, and why it stopped early."""
    result = ctx.result
    parts = [f"fit end: {result.steps} steps in {format_duration(result.elapsed_s)}"]
    if result.final_loss is not None:
        parts.append(f"final loss {format_float(result.final_loss)}")
    if result.metrics:
        rate = result.metrics[-1].get("steps_per_sec")
        if isinstance(rate, (int, float)):
            parts.append(f"{rate:.1f} steps/s")
    if ctx.stop_reason is not None:
        parts.append(f"stopped: {ctx.stop_reason}")
    return " | ".join(parts)


@dataclass(frozen=True)
class ConsoleOptions:
    """The ``console`` sink's options."""

    file: Annotated[
        str | None,
        Opt(
            "write to this text file (appended, line-buffered; relative to the output "
            "directory) instead of the terminal",
            default_text="`logging.file`",
        ),
    ] = None
    stream: Annotated[StreamName, Opt("the terminal stream used when no file is set")] = "stdout"
    keys: Annotated[
        list[str],
        Opt("record keys to show right after the standard fields, in this order"),
    ] = field(default_factory=list)
    other_keys: Annotated[
        bool,
        Opt(
            "also show every other key a callback logs; `false`: only the standard fields "
            "and `keys`"
        ),
    ] = True
    summary: Annotated[
        bool,
        Opt(
            "print the model summary (parameters, trainable, dtype per top-level module) "
            "under the start line"
        ),
    ] = True


@dataclass(frozen=True)
class ConsoleLoggingKeys:
    """The key this plugin adds to the ``logging:`` section (2.0's sink switch)."""

    console: Annotated[bool, Opt("add the default `console` sink")] = True


def options_from_logging(
    sections: SectionData, options: Mapping[str, object] | None
) -> PluginOptions | None:
    """2.0 ``logging.console: false`` leaves the default sink out; ``logging.file`` is the
    default of ``file``."""
    if options is None and not keys_of(sections, "logging", ConsoleLoggingKeys).console:
        return None
    merged: PluginOptions = dict(options or {})
    log_file = keys_of(sections, "logging", LoggingConfig).file
    if "file" not in merged and log_file is not None:
        merged["file"] = log_file
    return merged


@plugin(
    "console",
    options=ConsoleOptions,
    build=under_output_dir("file"),
    sections=Sections(
        keys=("logging",),
        declared={"logging": ConsoleLoggingKeys},
        to_options=options_from_logging,
    ),
    enabled_by_default=True,
    default_replaced_by=("progress",),
    implied_order=-20,  # the first sink, before the configured callbacks
)
class ConsoleCallback(MetricSink):
    """Plain text lines: a start line, one line per due record, a summary at the end."""

    def __init__(
        self,
        *,
        file: str | Path | None = ConsoleOptions.file,
        stream: StreamName = ConsoleOptions.stream,
        keys: Sequence[str] = (),
        summary: bool = ConsoleOptions.summary,
        other_keys: bool = ConsoleOptions.other_keys,
    ) -> None:
        self.file = Path(file) if file is not None else None
        self.summary = summary
        self.stream_name: StreamName = stream
        self.extra_keys = tuple(keys)
        self.other_keys = other_keys
        self._handle: IO[str] | None = None
        self._stream: IO[str] | None = None

    def run_paths(self, output_dir: Path) -> RunPaths:
        """The text file, when lines go to one, locked for the run."""
        return RunPaths(files=(resolve_path(self.file, output_dir),) if self.file else ())

    # -- output -------------------------------------------------------------------------

    def _write(self, line: str) -> None:
        if self.file is not None:
            if self.write_failure is not None or self._handle is None:
                return  # reported once (``write_failed``); the file's later lines are lost
            try:
                self._handle.write(line + "\n")
            except OSError as exc:
                raise self.write_failed(self.file, exc) from exc
        else:
            # tqdm.write clears and redraws any active bar on the stream around the line.
            tqdm.write(line, file=self._stream or sys.stdout)

    def _open(self) -> None:
        self.write_failure = None
        if self.file is not None and self._handle is None:
            try:
                self.file.parent.mkdir(parents=True, exist_ok=True)
                self._handle = open_to_append(self.file, buffering=1)
            except OSError as exc:
                raise self.write_failed(self.file, exc) from exc
        self._stream = sys.stderr if self.stream_name == "stderr" else sys.stdout

    def _close(self) -> None:
        handle, self._handle = self._handle, None
        if handle is None:
            return
        try:
            handle.close()  # flushes what line buffering still holds
        except OSError as exc:
            if self.write_failure is None:  # not reported yet: this is the one report
                assert self.file is not None
                raise self.write_failed(self.file, exc) from exc

    @property
    def closed(self) -> bool:
        """True when no file is held open (before setup and after teardown)."""
        return self._handle is None

    # -- hooks --------------------------------------------------------------------------

    def on_setup(self, trainer: TrainerView, ctx: FitContext) -> None:
        if self.file is not None:  # a relative file is under the run's output directory
            self.file = resolve_path(self.file, trainer.output_dir)
        self._open()

    def on_fit_start(self, trainer: TrainerView, ctx: FitContext) -> None:
        self._write(describe_fit_start(trainer, ctx))
        if self.summary:
            for line in _describe_model(trainer.model):
                self._write("  " + line)

    def write_record(self, trainer: TrainerView, record: Record) -> None:
        line = describe_record(record, trainer.target_step, self.extra_keys, other=self.other_keys)
        self._write(line)

    def on_fit_end(self, trainer: TrainerView, ctx: FitEndContext) -> None:
        self._write(_describe_fit_end(ctx))

    def on_exception(self, trainer: TrainerView, ctx: ExceptionContext) -> None:
        error = ctx.error
        self._write(f"fit failed after step {ctx.step}: {type(error).__name__}: {error}")

    def on_teardown(self, trainer: TrainerView, ctx: TeardownContext) -> None:
        self._close()
