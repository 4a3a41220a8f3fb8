"""``jsonl``: the canonical ``metrics.jsonl`` -- one JSON object per due record.

The file is append-only and flushed after every line, so a crash loses at most the line
being written. It is resume-safe: at ``setup`` every line whose ``step`` is beyond the step
the fit starts from is dropped (the file is rewritten atomically), so after a resume the
steps stay increasing with no duplicates. A torn last line (a crash mid-write) is dropped
the same way. A fresh fit (start step 0) in an existing output directory therefore starts
a new file.

Non-finite numbers (a NaN loss) are written as ``null``: the file stays strict JSON that
``jq``, pandas and browsers read.

A file that cannot be written (its path is a directory, the disk is full) is reported once
as a ``SinkWriteError`` naming the path and the reason (``sink.MetricSink.write_failed``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated

from speedtronic.config.declare import Opt, plugin
from speedtronic.engine.contexts import FitContext, TeardownContext
from speedtronic.plugins import PluginContext, PluginOptions, SectionData, Sections, keys_of
from speedtronic.state.append_io import open_to_append, refuse_planted_link
from speedtronic.state.atomic_io import atomic_write_text
from speedtronic.state.run_lock import RunPaths
from speedtronic.user_warnings import warn
from speedtronic_callbacks.sink import MetricSink, Record, keep_earlier_run, resolve_path

if TYPE_CHECKING:
    from speedtronic.engine.view import TrainerView

DEFAULT_FILENAME = "metrics.jsonl"


# Built once: json.dumps with non-default arguments constructs a new encoder per call.
_STRICT_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"))


def _c_encoder() -> Callable[[Record, int], Iterable[str]] | None:
    """``_STRICT_ENCODER``'s settings in CPython's C encoder, built once (``None`` without
    one). ``JSONEncoder.encode`` builds it anew on every call, with two Python frames around
    it: a third of a line's encoding. The text is the same. It keeps no circular-reference
    markers: a record is one flat mapping of numbers and strings, and a marker left behind
    by a failed call (a NaN) could fail a later record whose dict reuses the id."""
    try:
        from _json import make_encoder
    except ImportError:
        return None
    return make_encoder(
        None, _STRICT_ENCODER.default, json.encoder.encode_basestring_ascii, None, ":", ",",
        False, False, False,
    )  # fmt: skip


_C_ENCODER = _c_encoder()


def encode_record(record: Record) -> str:
    """One JSON line (no newline); NaN/Inf become ``null``."""
    try:
        if _C_ENCODER is not None:
            return "".join(_C_ENCODER(record, 0))
        return _STRICT_ENCODER.encode(record)
    except ValueError:  # only non-finite floats make allow_nan=False fail
        clean = {
            key: None if isinstance(value, float) and not math.isfinite(value) else value
            for key, value in record.items()
        }
        return _STRICT_ENCODER.encode(clean)


def _parse_line(line: str) -> dict[str, object] | None:
    try:
        parsed = json.loads(line)
    except json.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _line_step(line: str) -> int | None:
    parsed = _parse_line(line)
    step = parsed.get("step") if parsed is not None else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _truncate_after(path: Path, last_step: int) -> int:
    """Keep only lines with ``step <= last_step``; returns how many lines were dropped.

    The file is rewritten atomically, and only when something has to go.
    """
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept: list[str] = []
    for line in lines:
        if not line.strip():
            continue
        step = _line_step(line)
        if step is not None and step <= last_step and line.endswith("\n"):
            kept.append(line)
    dropped = sum(1 for line in lines if line.strip()) - len(kept)
    if dropped:
        atomic_write_text(path, "".join(kept))
    return dropped


@dataclass(frozen=True)
class JsonlOptions:
    """The ``jsonl`` sink's options."""

    path: Annotated[str, Opt("the JSONL file, relative to the output directory", min_length=1)] = (
        DEFAULT_FILENAME
    )
    event_key: Annotated[
        bool | None,
        Opt(
            'start each line with 2.0\'s `"event": "train_step"`; `null`: only when the file '
            "is the 2.0 `logging.json_file`"
        ),
    ] = None


@dataclass(frozen=True)
class JsonlLoggingKeys:
    """The keys this plugin adds to the ``logging:`` section (2.0's sink switch and file)."""

    json_file: Annotated[
        str | None,
        Opt(
            "the path of the default `jsonl` sink's file (relative to the run directory); "
            "`null` means `metrics.jsonl`",
            min_length=1,
        ),
    ] = None
    jsonl: Annotated[bool, Opt("add the default `jsonl` sink")] = True


def options_from_logging(
    sections: SectionData, options: Mapping[str, object] | None
) -> PluginOptions | None:
    """2.0 ``logging.jsonl: false`` leaves the default sink out; ``logging.json_file`` is the
    path of the default sink (a configured entry keeps its own ``path``)."""
    if options is not None:
        return dict(options)
    keys = keys_of(sections, "logging", JsonlLoggingKeys)
    if not keys.jsonl:
        return None
    return {} if keys.json_file is None else {"path": keys.json_file}


def _build(
    cls: type[JsonlCallback], options: JsonlOptions, context: PluginContext
) -> JsonlCallback:
    event_key = options.event_key
    if event_key is None:  # the 2.0 logging.json_file: lines as 2.0 wrote them
        json_file = context.config.logging.keys_of(JsonlLoggingKeys).json_file
        event_key = json_file is not None and json_file == options.path
    return cls(resolve_path(options.path, context.output_dir), event_key=event_key)


@plugin(
    "jsonl",
    options=JsonlOptions,
    build=_build,
    sections=Sections(
        keys=("logging",),
        declared={"logging": JsonlLoggingKeys},
        to_options=options_from_logging,
    ),
    enabled_by_default=True,
    implied_order=-10,  # after the default console sink
)
class JsonlCallback(MetricSink):
    """Appends each due record to ``metrics.jsonl`` in the output directory."""

    def __init__(self, path: str | Path = JsonlOptions.path, *, event_key: bool = False) -> None:
        self.path = Path(path)
        self._file = self.path  # the resolved path, once set up
        self.event_key = event_key
        """Lines carry 2.0's ``"event": "train_step"`` first (the 2.0 ``logging.json_file``)."""
        self._handle: IO[str] | None = None
        self.dropped_on_resume = 0

    def earlier_run_files(self) -> list[Path]:
        """A non-empty metrics file where this run will write (``LeavesRunFiles``); a path
        still relative to the run directory is only known at ``setup``, so it is not checked."""
        path = self.path
        return [path] if path.is_absolute() and path.is_file() and path.stat().st_size else []

    def run_paths(self, output_dir: Path) -> RunPaths:
        """The metrics file, locked for the run (``speedtronic.state.run_lock``)."""
        return RunPaths(files=(resolve_path(self.path, output_dir),))

    @property
    def closed(self) -> bool:
        """True when the file is not held open (before setup and after teardown)."""
        return self._handle is None

    def resolved_path(self, trainer: TrainerView) -> Path:
        """The file this sink writes (a relative path is under the trainer's output dir)."""
        return resolve_path(self.path, trainer.output_dir)

    def on_setup(self, trainer: TrainerView, ctx: FitContext) -> None:
        path = self._file = self.resolved_path(trainer)
        self.write_failure = None
        self.dropped_on_resume = 0
        try:
            refuse_planted_link(path)  # never read, renamed or appended through
            path.parent.mkdir(parents=True, exist_ok=True)
            keep_earlier_run(path, ctx.start_step)
            if path.is_file():
                self.dropped_on_resume = _truncate_after(path, ctx.start_step)
            self._handle = open_to_append(path)
        except OSError as exc:
            raise self.write_failed(path, exc) from exc
        if self.dropped_on_resume and ctx.start_step > 0:
            warn(
                f"{path}: removed {self.dropped_on_resume} line(s) after step "
                f"{ctx.start_step} or unreadable, so the file continues where this fit "
                "resumes",
                UserWarning,
            )

    def write_record(self, trainer: TrainerView, record: Record) -> None:
        handle = self._handle
        if handle is None:
            raise RuntimeError("the jsonl sink received a record before setup")
        if self.event_key:
            record = {"event": "train_step", **record}
        try:
            handle.write(encode_record(record) + "\n")
            handle.flush()
        except OSError as exc:
            raise self.write_failed(self._file, exc) from exc

    def on_teardown(self, trainer: TrainerView, ctx: TeardownContext) -> None:
        handle, self._handle = self._handle, None
        if handle is None:
            return
        try:
            handle.close()
        except OSError as exc:
            if self.write_failure is None:  # not reported yet: this is the one report
                raise self.write_failed(self._file, exc) from exc
