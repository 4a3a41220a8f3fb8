"""``plot_run``: a PNG of a finished (or running) run from its ``metrics.jsonl``.

    speedtronic plot runs/demo                          # writes runs/demo/metrics.png
    speedtronic plot runs/demo --keys loss,eval/loss grad_max

By default the panels are: loss with the held-out ``eval/loss`` (log scale when it spans a
decade), the gradient
norm when logged, every learning-rate key, throughput (tokens/s, or steps/s when no tokens
are counted), device memory when ``memory_bytes`` was logged, then one panel for each other
key the run logged (a callback's own keys included; the counters ``samples``, ``tokens``,
``elapsed_s``, ... are left out). ``--keys`` draws the panels it names instead. A dashed line
marks where a resumed fit continued the file. No server and no display are needed: the
figure is drawn with matplotlib's Agg canvas without touching pyplot's global state.
matplotlib is the optional ``plot`` extra (``pip install 'speedtronic[plot]'``).
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["PlotError", "draw_run", "load_series", "plot_run"]

_METRICS_FILENAME = "metrics.jsonl"
_PLOT_FILENAME = "metrics.png"

_LOSS_KEYS = ("loss", "eval/loss")
"""Drawn together on one log-scale panel: the training loss and the held-out loss."""

_COUNTER_KEYS = frozenset(
    {
        "samples",
        "tokens",
        "micro_batches",
        "elapsed_s",
        "steps_per_sec",
        "samples_per_sec",
        "tokens_per_sec",
        "memory_peak_bytes",
    }
)
"""Keys of every record that the default panels show in another form (or not at all):
cumulative counters and the throughput rates besides the one drawn."""

MAX_EXTRA_PANELS = 9
"""Other keys drawn by default, one panel each; more are named in the title (use ``keys``)."""

_COLUMNS = 3
"""Panels per row of the figure."""


class PlotError(RuntimeError):
    """The plot cannot be made: matplotlib is missing, there are no metrics to draw, or a
    requested key was not logged."""


@dataclass
class _RunSeries:
    """Numeric series of a metrics file, keyed by record key, each as (steps, values)."""

    series: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    resumed_at: list[int] = field(default_factory=list)
    """The step each resumed fit started from (its checkpoint's step), found where the fit
    start read back from a record's rate changes (``_fit_start``), or where ``elapsed_s``
    starts again in records without a rate."""

    def get(self, key: str) -> tuple[list[int], list[float]] | None:
        return self.series.get(key)

    def keys_starting(self, prefix: str) -> list[str]:
        return sorted(key for key in self.series if key == prefix or key.startswith(prefix + "/"))


@dataclass(frozen=True)
class _Panel:
    """One axes of the figure: the keys it draws, its title and whether its y axis may be
    logarithmic (it is when the values span a decade)."""

    title: str
    keys: tuple[str, ...]
    log_y: bool = False


def _read_records(path: Path) -> dict[int, dict[str, object]]:
    """Records by step; a later record for the same step wins (a resumed file)."""
    by_step: dict[int, dict[str, object]] = {}
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line of a crashed run
            step = record.get("step") if isinstance(record, dict) else None
            if isinstance(step, int) and not isinstance(step, bool):
                by_step[step] = record
    return by_step


def _number(value: object) -> float | None:
    """``value`` as a finite float, or None (text, booleans, ``null`` and NaN are no points)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def load_series(path: Path) -> _RunSeries:
    """Every numeric key of a metrics JSONL file as a series ordered by step."""
    if not path.is_file():
        raise PlotError(f"no metrics file at {path} (the jsonl sink writes it during a fit)")
    records = _read_records(path)
    if not records:
        raise PlotError(f"{path} holds no metric records")
    result = _RunSeries()
    # (step, elapsed_s, the fit's start step) of the record before
    previous: tuple[int, float, int | None] | None = None
    for step in sorted(records):
        for key, value in records[step].items():
            number = _number(value)
            if key == "step" or number is None:
                continue
            steps, values = result.series.setdefault(key, ([], []))
            steps.append(step)
            values.append(number)
        elapsed = _number(records[step].get("elapsed_s"))
        if elapsed is not None:
            start = _fit_start(records[step], step)
            if previous is not None and _another_fit(previous, elapsed, start):
                result.resumed_at.append(previous[0] if start is None else start)
            previous = (step, elapsed, start)
    return result


def _another_fit(
    previous: tuple[int, float, int | None], elapsed: float, start: int | None
) -> bool:
    """Whether a record (its ``elapsed_s`` and fit start) belongs to another fit than the
    record before: the start step read back changed, or -- for records without the rate --
    ``elapsed_s`` started again. The start step is what decides where both have it: a short
    resumed fit can log a larger ``elapsed_s`` than the fit before it did (its first steps
    pay one-off costs), so a clock running backwards is not a reliable sign."""
    _, before_elapsed, before_start = previous
    if start is not None and before_start is not None:
        return start != before_start
    return elapsed < before_elapsed


def _fit_start(record: Mapping[str, object], step: int) -> int | None:
    """The step the fit that logged ``record`` started from: ``steps_per_sec`` is
    ``(step - start) / elapsed_s``, so ``start`` is read back from the two (a resume from
    step 139 logs step 140 first, whatever the logging cadence). ``None`` when the record
    does not have them."""
    rate, elapsed = _number(record.get("steps_per_sec")), _number(record.get("elapsed_s"))
    if rate is None or elapsed is None:
        return None
    start = round(step - rate * elapsed)
    return start if 0 <= start < step else None


def _default_panels(series: _RunSeries) -> list[_Panel]:
    """The panels drawn without ``keys``: the core metrics, then every other logged key."""
    throughput = "tokens_per_sec" if series.get("tokens_per_sec") else "steps_per_sec"
    panels = [_Panel("loss", _LOSS_KEYS, log_y=True)]
    if series.get("grad_norm"):
        panels.append(_Panel("gradient norm (before clipping)", ("grad_norm",)))
    panels.append(_Panel("learning rate", tuple(series.keys_starting("lr"))))
    panels.append(_Panel(throughput.replace("_per_sec", "/s"), (throughput,)))
    if series.get("memory_bytes"):
        panels.append(_Panel("device memory (bytes)", ("memory_bytes", "memory_peak_bytes")))
    drawn = {key for panel in panels for key in panel.keys} | _COUNTER_KEYS
    others = [key for key in sorted(series.series) if key not in drawn]
    return panels + [_Panel(key, (key,)) for key in others[:MAX_EXTRA_PANELS]]


def _requested_panels(series: _RunSeries, requested: Sequence[str | Sequence[str]]) -> list[_Panel]:
    """One panel per item of ``requested``: a key, or several (``"loss,eval/loss"`` or a
    list) that share the panel. A key names itself and every key under it (``lr`` is ``lr``
    and ``lr/group1``). ``PlotError`` for a key the run did not log."""
    panels = []
    for item in requested:
        names = item.split(",") if isinstance(item, str) else list(item)
        keys: list[str] = []
        for name in (name.strip() for name in names):
            found = series.keys_starting(name)
            if not found:
                raise PlotError(_not_logged(series, name))
            keys.extend(key for key in found if key not in keys)
        log_y = any(key in _LOSS_KEYS for key in keys)
        panels.append(_Panel(", ".join(names), tuple(keys), log_y=log_y))
    if not panels:
        raise PlotError("no keys to draw were given")
    return panels


def _not_logged(series: _RunSeries, name: str) -> str:
    close = difflib.get_close_matches(name, sorted(series.series), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return (
        f"key {name!r} was not logged (as a number) in this run: {hint}"
        f"logged: {', '.join(sorted(series.series))}"
    )


def _values(series: _RunSeries, keys: Sequence[str]) -> list[float]:
    return [value for key in keys for value in (series.get(key) or ([], []))[1]]


def _spans_a_decade(series: _RunSeries, keys: Sequence[str]) -> bool:
    """Positive values over a factor of 10 or more: a log scale shows them better (within
    one decade a linear scale reads the same and labels more ticks)."""
    values = _values(series, keys)
    return bool(values) and min(values) > 0 and max(values) >= 10 * min(values)


def _plain_log_ticks(axes: Axes) -> None:
    """Label a log axis with plain numbers (``2``, ``0.5``), not ``2×10⁰``: the decades,
    and within a range under ~1.5 decades the minor ticks too (1-2-5 when it nears one)."""
    from matplotlib.ticker import FuncFormatter

    def major(value: float, _: object) -> str:
        return f"{value:.3g}"

    def minor(value: float, _: object) -> str:
        low, high = axes.get_ylim()
        decades = math.log10(high / low) if low > 0 and high > low else 0.0
        mantissa = round(value / 10 ** math.floor(math.log10(value)), 6) if value > 0 else 0.0
        if decades > 1.5 or (decades > 0.7 and mantissa not in (2.0, 3.0, 5.0)):
            return ""
        return f"{value:.3g}"

    axes.yaxis.set_major_formatter(FuncFormatter(major))
    axes.yaxis.set_minor_formatter(FuncFormatter(minor))


def _style_ticks(axes: Axes, values: Sequence[float], log_y: bool) -> None:
    """Tick labels a reader takes in at a glance: ``0.003``, ``31.1k``, ``2.5G`` -- never an
    offset or a ``1e8`` multiplier above the axis."""
    from matplotlib.ticker import EngFormatter, FuncFormatter

    if log_y:
        _plain_log_ticks(axes)
    elif max(abs(value) for value in values) >= 1e4:
        axes.yaxis.set_major_formatter(EngFormatter(sep=""))
    else:
        axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:.4g}"))


def _draw(axes: Axes, series: _RunSeries, panel: _Panel) -> None:
    drawn = False
    for key in panel.keys:
        data = series.get(key)
        if data is None:
            continue
        sparse = key.startswith("eval/")  # evaluated every few steps: show the points
        axes.plot(data[0], data[1], label=key, linewidth=1.2, marker="o" if sparse else None, ms=3)
        drawn = True
    for step in series.resumed_at:
        axes.axvline(step, color="0.45", linestyle="--", linewidth=1.0, label=f"resumed at {step}")
    axes.set_title(panel.title)
    axes.set_xlabel("step")
    axes.grid(True, alpha=0.3)
    if not drawn:
        axes.text(0.5, 0.5, "not logged", ha="center", va="center", transform=axes.transAxes)
        return
    log_y = panel.log_y and _spans_a_decade(series, panel.keys)
    if log_y:
        axes.set_yscale("log")
    _style_ticks(axes, _values(series, panel.keys), log_y)
    axes.legend(loc="best", fontsize="small")


def draw_run(
    output_dir: Path | str, *, keys: Sequence[str | Sequence[str]] | None = None
) -> Figure:
    """The figure of ``<output_dir>/metrics.jsonl``: ``_default_panels``, or with ``keys``
    the panels they name (``_requested_panels``). Not saved (``plot_run`` saves it)."""
    run_dir = Path(output_dir)
    series = load_series(run_dir / _METRICS_FILENAME)
    panels = _default_panels(series) if keys is None else _requested_panels(series, keys)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotError("plotting needs matplotlib: pip install 'speedtronic[plot]'") from exc

    columns = min(len(panels), _COLUMNS)
    rows = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(5.5 * columns, 3.8 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    grid = list(figure.subplots(rows, columns, squeeze=False).flat)
    for axes, panel in zip(grid, panels, strict=False):
        _draw(axes, series, panel)
    for axes in grid[len(panels) :]:  # the empty cells of the last row
        axes.remove()
    title = run_dir.resolve().name
    skipped = _skipped_keys(series) if keys is None else 0
    if skipped:
        title += f" ({skipped} more keys were logged: choose them with --keys)"
    figure.suptitle(title)
    return figure


def _skipped_keys(series: _RunSeries) -> int:
    """How many logged keys the default panels leave out beyond ``MAX_EXTRA_PANELS``."""
    shown = {key for panel in _default_panels(series) for key in panel.keys} | _COUNTER_KEYS
    return sum(1 for key in series.series if key not in shown)


def plot_run(
    output_dir: Path | str,
    out: Path | str | None = None,
    *,
    keys: Sequence[str | Sequence[str]] | None = None,
) -> Path:
    """Draw ``<output_dir>/metrics.jsonl`` into a PNG (default ``<output_dir>/metrics.png``);
    ``keys`` as for ``draw_run``.

    Raises ``PlotError`` when matplotlib is not installed, the file is missing or empty, or
    a requested key was not logged. Returns the path written.
    """
    figure = draw_run(output_dir, keys=keys)
    target = Path(out) if out is not None else Path(output_dir) / _PLOT_FILENAME
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, format="png", dpi=100)
    return target
