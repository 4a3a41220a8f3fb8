"""``plot_run``: a PNG of a finished (or running) run from its ``metrics.jsonl``.

    speedtronic plot runs/demo            # writes runs/demo/metrics.png

Panels: loss (and ``grad_norm`` when logged) against step, every learning-rate key against
step, and throughput (tokens/s, or steps/s when no tokens are counted). A fourth panel
shows device memory when the run logged ``memory_bytes``. No server and no display are
needed: the figure is drawn with matplotlib's Agg canvas without touching pyplot's global
state. matplotlib is the optional ``plot`` extra (``pip install 'speedtronic[plot]'``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["METRICS_FILENAME", "PlotError", "RunSeries", "load_series", "plot_run"]

METRICS_FILENAME = "metrics.jsonl"
PLOT_FILENAME = "metrics.png"


class PlotError(RuntimeError):
    """The plot cannot be made: matplotlib is missing, or there are no metrics to draw."""


@dataclass
class RunSeries:
    """Numeric series of a metrics file, keyed by record key, each as (steps, values)."""

    series: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)

    def get(self, key: str) -> tuple[list[int], list[float]] | None:
        return self.series.get(key)

    def keys_starting(self, prefix: str) -> list[str]:
        return sorted(key for key in self.series if key == prefix or key.startswith(prefix + "/"))


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


def load_series(path: Path) -> RunSeries:
    """Every numeric key of a metrics JSONL file as a series ordered by step."""
    if not path.is_file():
        raise PlotError(f"no metrics file at {path} (the jsonl sink writes it during a fit)")
    records = _read_records(path)
    if not records:
        raise PlotError(f"{path} holds no metric records")
    result = RunSeries()
    for step in sorted(records):
        for key, value in records[step].items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if not math.isfinite(value):
                continue
            steps, values = result.series.setdefault(key, ([], []))
            steps.append(step)
            values.append(float(value))
    return result


def _all_positive(series: RunSeries, keys: Sequence[str]) -> bool:
    values = [v for key in keys for v in (series.get(key) or ([], []))[1]]
    return bool(values) and min(values) > 0


def _draw(axes: Axes, series: RunSeries, keys: Sequence[str], title: str, log_y: bool) -> None:
    drawn = False
    for key in keys:
        data = series.get(key)
        if data is None:
            continue
        axes.plot(data[0], data[1], label=key, linewidth=1.2)
        drawn = True
    axes.set_title(title)
    axes.set_xlabel("step")
    axes.grid(True, alpha=0.3)
    if drawn:
        axes.legend(loc="best", fontsize="small")
        if log_y and _all_positive(series, keys):
            axes.set_yscale("log")
    else:
        axes.text(0.5, 0.5, "not logged", ha="center", va="center", transform=axes.transAxes)


def plot_run(output_dir: Path | str, out: Path | str | None = None) -> Path:
    """Draw ``<output_dir>/metrics.jsonl`` into a PNG (default ``<output_dir>/metrics.png``).

    Raises ``PlotError`` when matplotlib is not installed or the file is missing or empty.
    Returns the path written.
    """
    run_dir = Path(output_dir)
    series = load_series(run_dir / METRICS_FILENAME)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotError("plotting needs matplotlib: pip install 'speedtronic[plot]'") from exc

    throughput = "tokens_per_sec" if series.get("tokens_per_sec") else "steps_per_sec"
    panels: list[tuple[list[str], str, bool]] = [
        (["loss", "grad_norm"], "loss", True),
        (series.keys_starting("lr"), "learning rate", False),
        ([throughput], throughput.replace("_per_sec", "/s"), False),
    ]
    if series.get("memory_bytes"):
        panels.append((["memory_bytes", "memory_peak_bytes"], "device memory (bytes)", False))

    figure = Figure(figsize=(6.0 * len(panels), 4.0), layout="constrained")
    FigureCanvasAgg(figure)
    axes_row = figure.subplots(1, len(panels), squeeze=False)[0]
    for axes, (keys, title, log_y) in zip(axes_row, panels, strict=True):
        _draw(axes, series, keys, title, log_y)
    figure.suptitle(run_dir.resolve().name)

    target = Path(out) if out is not None else run_dir / PLOT_FILENAME
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, format="png", dpi=100)
    return target
