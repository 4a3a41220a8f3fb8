"""Building blocks shared by the metric sinks: the ``MetricSink`` base class and helpers.

A sink is an observer callback (``is_observer = True``: its failures warn once and
training goes on) that runs in the ``consume`` phase of the ``metrics`` event, after every
contributor added its keys. Its ``on_metrics`` is due only on the run's logging steps
(``due_when``), so a step on which nothing is logged builds no record and never pays for a
device-to-host copy.

A sink that cannot write its file (a directory in the way, a full disk) raises
``SinkWriteError`` naming itself, the path and the reason, once: ``write_failed`` records the
failure, later records are dropped without another report, and closing the file does not
report it again. The observer guard turns that one error into one ``CallbackWarning``;
``speedtronic fit`` then exits 1 at the end (docs/sinks.md).
"""

from __future__ import annotations

import abc
import dataclasses
import math
import os
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal, TypeVar

from speedtronic.config.declare import keyword_build
from speedtronic.engine.callback import Callback, RankPolicy
from speedtronic.engine.contexts import MetricsContext
from speedtronic.engine.filters import METRICS_ON_LOGGING_STEPS
from speedtronic.engine.metrics import MetricValue
from speedtronic.state.run_lock import resolve_run_path
from speedtronic.user_warnings import warn

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from speedtronic.engine.view import TrainerView
    from speedtronic.plugins import PluginContext

Built = TypeVar("Built", bound=Callback)
Options = TypeVar("Options", bound="DataclassInstance")

Record = Mapping[str, MetricValue]
"""A finished metric record as plain Python values (``MetricRecord.values()``)."""


class SinkWriteError(OSError):
    """A metric sink cannot write its file: names the sink, the path and the reason."""


class MetricSink(Callback, abc.ABC):
    """Base class of sinks: implement ``write_record``; it is called once per due record.

    Open files in ``on_setup`` and close them in ``on_teardown`` (which also runs when
    the fit fails), so a sink never leaks a handle. In a distributed run sinks run on rank 0
    only (``rank_policy = "main"``), where the metrics are already reduced across ranks.
    """

    is_observer: ClassVar[bool] = True
    metrics_phase: ClassVar[Literal["contribute", "consume"]] = "consume"
    rank_policy: ClassVar[RankPolicy] = "main"  # one copy of the logs per run, from rank 0
    due_when = METRICS_ON_LOGGING_STEPS
    write_failure: str | None = None
    """Why this sink stopped writing (set by ``write_failed``); ``None`` while it works."""

    def on_metrics(self, trainer: TrainerView, ctx: MetricsContext) -> None:
        if self.write_failure is None:  # a sink that failed to write was reported once
            self.write_record(trainer, ctx.record.finished())

    def write_failed(self, path: Path, error: OSError) -> SinkWriteError:
        """Record that writing ``path`` failed with ``error``; returns the error to raise.
        Records after it are dropped (``on_metrics``) without another report."""
        reason = error.strerror or str(error)
        self.write_failure = (
            f"the {self.display_name} sink cannot write {path}: {reason} "
            "(its records are lost from here on)"
        )
        failure = SinkWriteError(self.write_failure)
        failure.errno = error.errno
        return failure

    @abc.abstractmethod
    def write_record(self, trainer: TrainerView, record: Record) -> None:
        """Write one finished record (all values already plain numbers or strings)."""

    @property
    def closed(self) -> bool:
        """True when the sink holds nothing open (before ``setup``, after ``teardown``).
        Sinks that open files, writers or runs override this."""
        return True


def resolve_path(path: str | os.PathLike[str], output_dir: Path) -> Path:
    """``path`` itself when absolute, else ``output_dir / path`` (``~`` is expanded): the
    one rule of ``speedtronic.state.run_lock.resolve_run_path``."""
    return resolve_run_path(path, output_dir)


def under_output_dir(
    *paths: str,
) -> Callable[[type[Built], Options, PluginContext], Built]:
    """The builder of a plugin whose options ``paths`` name files or directories: each one
    (when set) resolved under the run's output directory (``resolve_path``), then every
    option passed as the keyword of its name (``keyword_build``)."""

    def build(cls: type[Built], options: Options, context: PluginContext) -> Built:
        resolved = {
            name: str(resolve_path(value, context.output_dir))
            for name in paths
            if isinstance(value := getattr(options, name), str)
        }
        return keyword_build(cls, dataclasses.replace(options, **resolved))

    return build


def keep_earlier_run(path: Path, start_step: int) -> Path | None:
    """Before a fit that starts from step 0 appends to ``path``: an earlier run's non-empty
    file there is renamed to the first free ``<stem>.<n><suffix>`` and a warning names both,
    so a fresh run never truncates what another run wrote. (The CLI refuses such a run
    directory before this point; this covers a ``Trainer`` built in Python.) Returns the new
    name, or ``None`` when there was nothing to keep."""
    if start_step != 0 or not path.is_file() or path.stat().st_size == 0:
        return None
    number = 1
    while (kept := path.with_name(f"{path.stem}.{number}{path.suffix}")).exists():
        number += 1
    path.rename(kept)
    warn(
        f"{path} held an earlier run's records; kept them as {kept.name} and started a new "
        "file (resume the earlier run to continue it instead)",
        UserWarning,
    )
    return kept


NumberFormat = tuple[str, Callable[[float], str]]
"""A record key and how to show its value on a text line."""


def formatted_numbers(record: Record, fields: Sequence[NumberFormat]) -> list[str]:
    """Each field's text, in order, for the keys whose value in ``record`` is a number."""
    parts = []
    for key, show in fields:
        value = record.get(key)
        if value is None:  # most fields are absent from most records: the cheap test first
            continue
        kind = type(value)
        if kind is float or kind is int or (isinstance(value, (int, float)) and kind is not bool):
            parts.append(show(float(value)))
    return parts


_TRAINER_COUNTERS = frozenset(
    {"step", "samples", "tokens", "micro_batches", "elapsed_s", "samples_per_sec"}
)
"""Keys the trainer puts in every record that the text sinks do not repeat on each line
(their standard fields show the step, loss, rates and learning rate instead)."""


def other_keys(record: Iterable[str], shown: Collection[str]) -> list[str]:
    """The keys of ``record`` a text line does not show yet, in name order (so a callback's
    ``prefix/...`` keys stand together): every key a callback logged (``mine/grad_max``,
    ``host/rss_bytes``, ``diloco/...``), not the trainer's counters or its per-group
    learning rates."""
    return sorted(
        key
        for key in record
        if key not in shown and key not in _TRAINER_COUNTERS and not key.startswith("lr/")
    )


def format_value(key: str, value: MetricValue) -> str:
    """A record value as a text sink shows it, by the unit its key ends with: ``*_bytes``
    in binary units (326.94MiB), ``*_percent`` as 79.3%, ``*_per_sec`` as 8.5G; other floats
    as ``format_float``, integers and text as they are."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if key.endswith("_bytes"):
        return format_bytes(float(value))
    if key.endswith("_percent"):
        return f"{value:.1f}%"
    if key.endswith("_per_sec"):
        return format_si(float(value))
    return format_float(value) if isinstance(value, float) else str(value)


def numeric_items(record: Record) -> Iterator[tuple[str, float]]:
    """``(key, value)`` for every numeric value except ``step`` (booleans excluded)."""
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        yield key, float(value)


def format_si(value: float, digits: int = 1) -> str:
    """A compact human number: 950, 1.2k, 3.4M, 5.6G."""
    magnitude = abs(value)
    # Unrolled (a rate is formatted on every logged line); ``not >=`` keeps NaN here.
    if not magnitude >= 1e3:
        return f"{value:.{digits}f}" if magnitude < 100 and value != int(value) else f"{value:.0f}"
    if magnitude < 1e6:
        threshold, suffix = 1e3, "k"
    elif magnitude < 1e9:
        threshold, suffix = 1e6, "M"
    elif magnitude < 1e12:
        threshold, suffix = 1e9, "G"
    else:
        threshold, suffix = 1e12, "T"
    return f"{value / threshold:.{digits}f}{suffix}"


def format_bytes(value: float) -> str:
    """Bytes as binary units: 512.0MiB, 1.50GiB."""
    for threshold, suffix in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if value >= threshold:
            return f"{value / threshold:.2f}{suffix}"
    return f"{value:.0f}B"


def format_float(value: float) -> str:
    """A loss-like number: 4 decimals in the usual range, scientific outside it."""
    if not math.isfinite(value):
        return str(value)
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
        return f"{value:.3e}"
    return f"{value:.4f}"


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` (or ``M:SS`` under an hour)."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
