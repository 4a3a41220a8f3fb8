"""``plot_run``: a PNG from ``metrics.jsonl`` without a display or a server."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from sink_helpers import make_trainer

from speedtronic.plotting import PlotError, load_series, plot_run
from speedtronic_callbacks.jsonl import JsonlCallback

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_plot_writes_a_png_of_a_finished_run(tmp_path: Path) -> None:
    make_trainer(tmp_path, [JsonlCallback()], max_steps=6).fit()
    written = plot_run(tmp_path)
    assert written == tmp_path / "metrics.png"
    data = written.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    from matplotlib.image import imread

    height, width = imread(written).shape[:2]
    assert width > height > 0  # one row of panels


def test_plot_to_an_explicit_path(tmp_path: Path) -> None:
    make_trainer(tmp_path / "run", [JsonlCallback()], max_steps=3).fit()
    target = tmp_path / "figures" / "run.png"
    assert plot_run(str(tmp_path / "run"), target) == target
    assert target.read_bytes().startswith(PNG_MAGIC)


def test_series_keep_the_last_record_per_step_and_skip_non_numbers(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"step": 1, "loss": 3.0, "lr": 0.1, "note": "x"}\n'
        '{"step": 2, "loss": null, "lr": 0.1}\n'
        '{"step": 2, "loss": 2.0, "lr": 0.1}\n'
        '{"step": 3, "lo',
        encoding="utf-8",
    )
    series = load_series(path)
    assert series.get("loss") == ([1, 2], [3.0, 2.0])
    assert series.get("note") is None
    assert series.keys_starting("lr") == ["lr"]


def test_missing_or_empty_metrics_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(PlotError, match="no metrics file at .*metrics.jsonl"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("", encoding="utf-8")
    with pytest.raises(PlotError, match="holds no metric records"):
        plot_run(tmp_path)


def test_missing_matplotlib_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n', encoding="utf-8")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import now raises
    with pytest.raises(PlotError, match=r"pip install 'speedtronic\[plot\]'"):
        plot_run(tmp_path)
