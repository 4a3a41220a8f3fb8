"""``tensorboard``: every numeric key of each due record as a TensorBoard scalar, and every
text value (the ``text_samples`` callback's generations) as a text summary of its key.

Writes real event files with ``torch.utils.tensorboard.SummaryWriter`` into
``<output_dir>/tensorboard`` (``log_dir``). Tags are the record keys (``loss``, ``lr``,
``lr/group1``, ``tokens_per_sec``, ``memory_bytes``, ...), optionally under a ``prefix``;
the TensorBoard step is the global step.

Each record becomes one event holding all of its scalars (one protobuf instead of one event
per key), built and handed to the writer on a background thread: the training thread only
appends ``(step, scalars)`` to a queue, a few microseconds per logged step. On a resumed
fit the writer is opened with ``purge_step`` set to the first new step, so TensorBoard
hides the older run's points beyond the resume step instead of drawing two overlapping
curves.

A log directory that cannot be written (a file in the way, a full disk) is reported once,
naming the directory (``sink.MetricSink.write_failed``); failures of TensorBoard's own writer
thread surface on the next record.

Needs the ``logging`` extra (``pip install 'speedtronic[logging]'``).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from speedtronic.config.declare import Opt, plugin
from speedtronic.engine.contexts import FitContext, FitEndContext, TeardownContext
from speedtronic.state.run_lock import RunPaths
from speedtronic.util.worker import BackgroundWorker
from speedtronic_callbacks.sink import (
    MetricSink,
    Record,
    numeric_items,
    resolve_path,
    under_output_dir,
)

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from speedtronic.engine.view import TrainerView

_DEFAULT_LOG_DIR = "tensorboard"
_INSTALL_HINT = "the tensorboard sink needs tensorboard: pip install 'speedtronic[logging]'"


Scalars = tuple[int, list[tuple[str, float]], list[tuple[str, str]]]
"""One record's ``(step, scalars, texts)``."""
"""One record for the writer thread: ``(step, [(tag, value), ...])``."""

_SummaryBuilder = Callable[[list[tuple[str, float]]], object]
"""Builds one ``Summary`` protobuf holding ``(tag, value)`` scalars."""


def _summary_builder() -> _SummaryBuilder:
    """A ``_SummaryBuilder`` bound to tensorboard's protobuf classes (imported on first use)."""
    from tensorboard.compat.proto.summary_pb2 import Summary  # typed by typings/tensorboard

    def build(scalars: list[tuple[str, float]]) -> object:
        return Summary(value=[Summary.Value(tag=tag, simple_value=v) for tag, v in scalars])

    return build


def _require_tensorboard() -> None:
    """Raise ``ImportError`` with the install hint when tensorboard is missing."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ImportError(_INSTALL_HINT)


@dataclass(frozen=True)
class TensorBoardOptions:
    """The ``tensorboard`` sink's options."""

    log_dir: Annotated[
        str, Opt("event file directory, relative to the output directory", min_length=1)
    ] = _DEFAULT_LOG_DIR
    prefix: Annotated[str, Opt("prepended to every tag, e.g. `train/`")] = ""
    flush_secs: Annotated[
        int,
        Opt("how often the writer thread flushes to disk, in seconds", minimum=1, maximum=86400),
    ] = 10
    log_config: Annotated[
        bool, Opt("store the run's config (secrets redacted) as a text summary")
    ] = True


@plugin("tensorboard", options=TensorBoardOptions, build=under_output_dir("log_dir"))
class TensorBoardCallback(MetricSink):
    """Scalars for every numeric record key, written with a real ``SummaryWriter``."""

    def __init__(
        self,
        log_dir: str | Path = TensorBoardOptions.log_dir,
        *,
        prefix: str = TensorBoardOptions.prefix,
        flush_secs: int = TensorBoardOptions.flush_secs,
        log_config: bool = TensorBoardOptions.log_config,
    ) -> None:
        _require_tensorboard()
        self.log_dir = Path(log_dir)
        self.prefix = prefix
        self.flush_secs = flush_secs
        self.log_config = log_config
        self.writer: SummaryWriter | None = None
        self._resolved = self.log_dir  # the resolved log_dir, once set up
        self._build_summary: _SummaryBuilder | None = None
        self._worker: BackgroundWorker[Scalars] | None = None

    def run_paths(self, output_dir: Path) -> RunPaths:
        """The log directory, locked for the run: another run's event files there would
        show as this run's curves."""
        return RunPaths(directories=(resolve_path(self.log_dir, output_dir),))

    @property
    def closed(self) -> bool:
        return self.writer is None

    def on_setup(self, trainer: TrainerView, ctx: FitContext) -> None:
        from torch.utils.tensorboard import SummaryWriter

        log_dir = self._resolved = resolve_path(self.log_dir, trainer.output_dir)
        self.write_failure = None
        self._build_summary = _summary_builder()
        try:
            self.writer = SummaryWriter(
                log_dir=str(log_dir),
                # A resumed fit hides the previous session's points past the resume step.
                purge_step=ctx.start_step + 1 if ctx.start_step > 0 else None,
                max_queue=1000,
                flush_secs=self.flush_secs,
            )
            run_config = trainer.run_config if self.log_config else None
            if run_config is not None:
                text = json.dumps(run_config, indent=2, default=str)
                # Four-space indent renders as a code block in TensorBoard's markdown view.
                self.writer.add_text(
                    "config", "    " + text.replace("\n", "\n    "), ctx.start_step
                )
        except OSError as exc:
            raise self.write_failed(log_dir, exc) from exc
        self._worker = BackgroundWorker(
            "speedtronic-tensorboard", self._write_event, interval_s=0.1
        )

    def write_record(self, trainer: TrainerView, record: Record) -> None:
        if self._worker is None:
            raise RuntimeError("the tensorboard sink received a record before setup")
        scalars = [(self.prefix + key, value) for key, value in numeric_items(record)]
        texts = [
            (self.prefix + key, value) for key, value in record.items() if isinstance(value, str)
        ]
        try:
            self._worker.submit((int(record["step"]), scalars, texts))
        except OSError as exc:  # a failed write of an earlier record, from the worker
            raise self.write_failed(self._resolved, exc) from exc

    def _write_event(self, item: Scalars) -> None:
        """On the worker thread: one event holding every scalar of a record."""
        writer, build = self.writer, self._build_summary
        if writer is None or build is None:
            raise RuntimeError("the tensorboard writer is closed")
        step, scalars, texts = item
        file_writer = writer._get_file_writer()  # type: ignore[no-untyped-call]  # torch leaves this helper unannotated
        file_writer.add_summary(build(scalars), step)
        for tag, text in texts:
            writer.add_text(tag, text, step)

    def on_fit_end(self, trainer: TrainerView, ctx: FitEndContext) -> None:
        self.flush()

    def flush(self) -> None:
        """Write every queued record and flush the event file (also the 2.0
        ``TensorboardHook.flush``); a failure reported once already is not raised again."""
        if self.write_failure is not None:
            return  # reported once already; teardown closes what is open
        try:
            if self._worker is not None:
                self._worker.drain()
            if self.writer is not None:
                self.writer.flush()
        except OSError as exc:
            raise self.write_failed(self._resolved, exc) from exc

    def on_teardown(self, trainer: TrainerView, ctx: TeardownContext) -> None:
        worker, self._worker = self._worker, None
        try:
            try:
                if worker is not None:
                    worker.close()  # writes what is still queued (the writer must be open)
            finally:
                writer, self.writer = self.writer, None
                if writer is not None:
                    writer.close()
        except OSError as exc:
            if self.write_failure is None:  # not reported yet: this is the one report
                raise self.write_failed(self._resolved, exc) from exc
