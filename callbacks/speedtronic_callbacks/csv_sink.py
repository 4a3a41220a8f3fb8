"""``csv``: due records as rows of ``metrics.csv`` (for spreadsheets and pandas).

The header is the union of the keys seen so far, in first-seen order. A record that brings
a new key (say ``lr/group1`` once param-group rates diverge) rewrites the file once with the
wider header; older rows get empty cells. Like the JSONL sink it is flushed per row and
resume-safe: rows beyond the step a fit starts from are dropped at ``setup``. A file that
cannot be written is reported once, naming the path (``sink.MetricSink.write_failed``).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated

from speedtronic.config.declare import Opt, plugin
from speedtronic.engine.contexts import FitContext, TeardownContext
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
    from speedtronic.engine.view import TrainerView

DEFAULT_FILENAME = "metrics.csv"


def _render(columns: Sequence[str], rows: Sequence[Mapping[str, object]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def _row_step(row: Mapping[str, str]) -> int | None:
    try:
        return int(row.get("step") or "")
    except ValueError:
        return None


def load_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """The header and rows of a metrics CSV (empty when the file is empty)."""
    with path.open(encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle)
        rows = [dict(row) for row in reader]
        return list(reader.fieldnames or []), rows


@dataclass(frozen=True)
class CsvOptions:
    """The ``csv`` sink's options."""

    path: Annotated[str, Opt("the CSV file, relative to the output directory", min_length=1)] = (
        DEFAULT_FILENAME
    )


@plugin("csv", options=CsvOptions, build=under_output_dir("path"))
class CsvCallback(MetricSink):
    """Appends each due record as a row of ``metrics.csv`` in the output directory."""

    def __init__(self, path: str | Path = CsvOptions.path) -> None:
        self.path = Path(path)
        self._file: Path | None = None
        self._handle: IO[str] | None = None
        self._writer: csv.DictWriter[str] | None = None
        self._columns: list[str] = []
        self._known: set[str] = set()

    def run_paths(self, output_dir: Path) -> RunPaths:
        """The CSV file, locked for the run (``speedtronic.state.run_lock``)."""
        return RunPaths(files=(resolve_path(self.path, output_dir),))

    @property
    def closed(self) -> bool:
        return self._handle is None

    def on_setup(self, trainer: TrainerView, ctx: FitContext) -> None:
        path = resolve_path(self.path, trainer.output_dir)
        self._file = path
        self._columns = []
        self.write_failure = None
        try:
            refuse_planted_link(path)  # never read, renamed or appended through
            path.parent.mkdir(parents=True, exist_ok=True)
            keep_earlier_run(path, ctx.start_step)
            if path.is_file() and path.stat().st_size > 0:
                columns, rows = load_rows(path)
                kept = [row for row in rows if (_row_step(row) or 0) <= ctx.start_step]
                if kept:
                    self._columns = columns
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
        self._writer = (
            csv.DictWriter(self._handle, fieldnames=self._columns, lineterminator="\n")
            if self._columns
            else None
        )

    def _widen(self, record: Record) -> None:
        """Start the file, or rewrite it with a header that has the record's new keys."""
        assert self._file is not None
        new_keys = [key for key in record if key not in self._columns]
        if self._columns:
            if self._handle is not None:
                self._handle.close()
                self._handle = None
            _, rows = load_rows(self._file)
            self._columns += new_keys
            atomic_write_text(self._file, _render(self._columns, rows))
        else:
            self._columns = list(record)
            atomic_write_text(self._file, _render(self._columns, []))
        self._reopen()

    def write_record(self, trainer: TrainerView, record: Record) -> None:
        if self._file is None:
            raise RuntimeError("the csv sink received a record before setup")
        try:
            if self._writer is None or not self._known.issuperset(record):
                self._widen(record)
            assert self._writer is not None and self._handle is not None
            self._writer.writerow(record)
            self._handle.flush()
        except OSError as exc:
            raise self.write_failed(self._file, exc) from exc

    def on_teardown(self, trainer: TrainerView, ctx: TeardownContext) -> None:
        handle, self._handle = self._handle, None
        self._writer = None
        if handle is None:
            return
        try:
            handle.close()
        except OSError as exc:
            if self.write_failure is None and self._file is not None:  # the one report
                raise self.write_failed(self._file, exc) from exc
