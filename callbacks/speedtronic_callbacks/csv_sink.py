"""``csv``: due records as rows of ``metrics.csv`` (for spreadsheets and pandas).

The file is always one valid CSV table: one header, then one row per due record, in order.
The header is the union of the keys seen so far, in first-seen order. A record that brings
a new key (say ``lr/group1`` once param-group rates diverge) widens the header, which means
rewriting the file (a header cannot grow in place); older rows get empty cells.

So that a run whose keys keep changing still costs time linear in what it writes, the bytes
rewritten for widenings stay within ``REWRITE_BUDGET`` times the file's size plus
``REWRITE_FLOOR_BYTES``. A key that appears when that budget is spent *waits*: its rows are
written at once with the columns the file already has, its cells are kept in memory, and
its column joins at the next widening the budget allows -- at the latest when the fit ends.
A widening happens at once while what was rewritten so far is at most the file's size
plus the floor: a few widenings spread over a run do not wait.

Like the JSONL sink it is flushed per row and resume-safe: rows beyond the step a fit
starts from are dropped at ``setup``. A file that cannot be written is reported once,
naming the path (``sink.MetricSink.write_failed``).
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated, ClassVar

from speedtronic.config.declare import Opt, plugin
from speedtronic.engine.contexts import FitContext, TeardownContext
from speedtronic.engine.metrics import MetricValue
from speedtronic.state.append_io import open_to_append, refuse_planted_link
from speedtronic.state.atomic_io import atomic_write_text
from speedtronic.state.run_lock import RunPaths
from speedtronic_callbacks.sink import (
    MetricSink,
    Record,
    keep_earlier_run,
    resolve_path,
    under_output_dir,
)

if TYPE_CHECKING:
    from _csv import Writer as _CsvWriter

    from speedtronic.engine.view import TrainerView

DEFAULT_FILENAME = "metrics.csv"


def _render(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return buffer.getvalue()


def _row_step(row: Sequence[str], column: int) -> int | None:
    try:
        return int(row[column]) if column < len(row) else None
    except ValueError:
        return None


def _load_table(path: Path) -> tuple[list[str], list[list[str]]]:
    """The header and rows (lists of cells) of a metrics CSV (empty when the file is)."""
    with path.open(encoding="utf-8", newline="") as handle:
        reader = csv.reader(handle)
        header = next(reader, [])
        return header, list(reader)


@dataclass(frozen=True)
class CsvOptions:
    """The ``csv`` sink's options."""

    path: Annotated[str, Opt("the CSV file, relative to the output directory", min_length=1)] = (
        DEFAULT_FILENAME
    )


@plugin("csv", options=CsvOptions, build=under_output_dir("path"))
class CsvCallback(MetricSink):
    """Appends each due record as a row of ``metrics.csv`` in the output directory."""

    REWRITE_BUDGET: ClassVar[int] = 2
    """Widenings rewrite at most this many times the file's size in all (plus the floor)."""
    REWRITE_FLOOR_BYTES: ClassVar[int] = 16 * 1024
    """Rewrites a small file may always afford: early widenings never wait."""

    def __init__(self, path: str | Path = CsvOptions.path) -> None:
        self.path = Path(path)
        self._file: Path | None = None
        self._handle: IO[str] | None = None
        self._writer: _CsvWriter | None = None
        self._columns: list[str] = []  # the header in the file
        self._known: set[str] = set()  # the header and the waiting keys
        self._waiting: list[str] = []  # keys seen, not in the file's header yet
        self._late: dict[int, dict[str, MetricValue]] = {}  # row index -> waiting cells
        self._rows = 0  # data rows in the file
        self.rewritten_bytes = 0
        """Bytes this fit rewrote to widen the header (the linear-cost budget's count)."""

    def run_paths(self, output_dir: Path) -> RunPaths:
        """The CSV file, locked for the run (``speedtronic.state.run_lock``)."""
        return RunPaths(files=(resolve_path(self.path, output_dir),))

    @property
    def closed(self) -> bool:
        return self._handle is None

    def on_setup(self, trainer: TrainerView, ctx: FitContext) -> None:
        path = resolve_path(self.path, trainer.output_dir)
        self._file = path
        self._columns, self._waiting, self._late = [], [], {}
        self._rows = self.rewritten_bytes = 0
        self.write_failure = None
        try:
            refuse_planted_link(path)  # never read, renamed or appended through
            path.parent.mkdir(parents=True, exist_ok=True)
            keep_earlier_run(path, ctx.start_step)
            if path.is_file() and path.stat().st_size > 0:
                columns, rows = _load_table(path)
                column = columns.index("step") if "step" in columns else len(columns)
                kept = [row for row in rows if (_row_step(row, column) or 0) <= ctx.start_step]
                if kept:
                    self._columns, self._rows = columns, len(kept)
                if len(kept) != len(rows) or not kept:
                    atomic_write_text(path, _render(columns, kept) if kept else "")
            self._reopen()
        except OSError as exc:
            raise self.write_failed(path, exc) from exc

    def _reopen(self) -> None:
        assert self._file is not None
        self._known = set(self._columns)
        if self._handle is not None:
            self._handle.close()
        self._handle = open_to_append(self._file, newline="")
        self._writer = csv.writer(self._handle, lineterminator="\n") if self._columns else None

    def _rewrite(self) -> None:
        """Rewrite the file with the waiting keys' columns and cells added."""
        assert self._file is not None
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        _, rows = _load_table(self._file)
        width, waiting = len(self._columns), self._waiting
        padding = [""] * len(waiting)
        wide: list[list[object]] = [[*row, *padding] for row in rows]
        for index, cells in self._late.items():
            wide[index][width:] = map(cells.get, waiting)
        self._columns += waiting
        self._waiting, self._late = [], {}
        text = _render(self._columns, wide)
        atomic_write_text(self._file, text)
        self.rewritten_bytes += len(text.encode("utf-8"))
        self._reopen()

    def _widen(self, record: Record) -> None:
        """Start the file, or widen its header now if the budget allows (else the keys wait)."""
        assert self._file is not None
        new_keys = [key for key in record if key not in self._known]
        if not self._columns:
            self._columns = list(record)
            atomic_write_text(self._file, _render(self._columns, []))
            self._reopen()
            return
        self._waiting += new_keys
        assert self._handle is not None
        size = os.fstat(self._handle.fileno()).st_size
        budget = self.REWRITE_BUDGET * size + self.REWRITE_FLOOR_BYTES
        if self.rewritten_bytes + size <= budget:
            self._rewrite()
        else:
            self._known.update(new_keys)

    def write_record(self, trainer: TrainerView, record: Record) -> None:
        if self._file is None:
            raise RuntimeError("the csv sink received a record before setup")
        try:
            if self._writer is None or not self._known.issuperset(record):
                self._widen(record)
            if self._waiting:
                cells = {key: record[key] for key in self._waiting if key in record}
                if cells:
                    self._late[self._rows] = cells
            assert self._writer is not None and self._handle is not None
            # One cell per column, in the header's order; a key the record lacks (``None``
            # from ``get``) is an empty cell, and a waiting key's cell is in ``_late``.
            self._writer.writerow(map(record.get, self._columns))
            self._rows += 1
            self._handle.flush()
        except OSError as exc:
            raise self.write_failed(self._file, exc) from exc

    def on_teardown(self, trainer: TrainerView, ctx: TeardownContext) -> None:
        try:
            if self._waiting and self._handle is not None and self.write_failure is None:
                self._rewrite()  # the waiting columns join before the file is left
        except OSError as exc:
            assert self._file is not None
            self._close_quietly()
            raise self.write_failed(self._file, exc) from exc
        handle, self._handle = self._handle, None
        self._writer = None
        if handle is None:
            return
        try:
            handle.close()
        except OSError as exc:
            if self.write_failure is None and self._file is not None:  # the one report
                raise self.write_failed(self._file, exc) from exc

    def _close_quietly(self) -> None:
        handle, self._handle, self._writer = self._handle, None, None
        if handle is not None:
            try:
                handle.close()
            except OSError:
                pass  # the rewrite's error is the one reported
