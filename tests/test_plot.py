"""``plot_run``: a PNG from ``metrics.jsonl`` without a display or a server."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml
from cli_runner import run_cli
from sink_helpers import make_trainer

from speedtronic.plotting import MAX_EXTRA_PANELS, PlotError, draw_run, load_series, plot_run
from speedtronic_callbacks.jsonl import JsonlCallback

if TYPE_CHECKING:
    from matplotlib.axes import Axes

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_plot_writes_a_png_of_a_finished_run(tmp_path: Path) -> None:
    make_trainer(tmp_path, [JsonlCallback()], max_steps=6).fit()
    written = plot_run(tmp_path)
    assert written == tmp_path / "metrics.png"
    data = written.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    from matplotlib.image import imread

    height, width = imread(written).shape[:2]
    assert width > height > 0  # rows of up to three panels


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


RUN = {
    "run": {"device": "cpu", "max_steps": 8, "seed": 3},
    "model": {"vocab_size": 32, "max_seq_len": 8, "n_layer": 1, "n_head": 2, "d_model": 16},
    "data": {"synthetic_kind": "learnable", "num_tokens": 64, "micro_batch_size": 2},
    "optimizer": {"lr": 0.01, "grad_clip": 1.0},
    "scheduler": {"warmup_steps": 1},
    "logging": {"every_steps": 2, "console": False},
    "checkpoint": {"every_steps": 4},
    "eval": {"every_steps": 4, "max_batches": 2},
}


def lines_of(axes: Axes) -> dict[str, tuple[list[float], list[float]]]:
    """The labelled lines of ``axes``: label -> (x, y)."""
    return {
        str(line.get_label()): (list(line.get_xdata()), list(line.get_ydata()))
        for line in axes.get_lines()
        if not str(line.get_label()).startswith("_")
    }


def test_plot_of_a_resumed_run_draws_what_it_logged(tmp_path: Path) -> None:
    """Stop at step 4, resume to 8, plot from the CLI: eval/loss beside the loss, grad_norm
    on its own axes, a line at the resume, plain tick labels."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(dict(RUN, run=dict(RUN["run"], output_dir="out"))))
    first = run_cli("fit", "--config", str(path), "--max-steps", "4", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    resumed = run_cli("fit", "--config", str(path), "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    done = run_cli("plot", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"wrote {Path('out') / 'metrics.png'}\n"

    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").open()]
    figure = draw_run(tmp_path / "out")
    panels = {str(axes.get_title()): axes for axes in figure.axes}
    assert list(panels)[:4] == [
        "loss",
        "gradient norm (before clipping)",
        "learning rate",
        "tokens/s",
    ]
    assert "eval/ppl" in panels  # every other key the run logged
    assert not {"samples", "tokens", "elapsed_s", "micro_batches"} & set(panels)
    loss = lines_of(panels["loss"])
    assert set(loss) == {"loss", "eval/loss", "resumed at 4"}
    assert loss["eval/loss"] == (
        [r["step"] for r in logged if "eval/loss" in r],
        [r["eval/loss"] for r in logged if "eval/loss" in r],
    )
    assert loss["loss"][0] == [2, 4, 6, 8]
    assert loss["resumed at 4"][0] == [4, 4]  # a vertical line at the resumed step
    assert set(lines_of(panels["gradient norm (before clipping)"])) == {"grad_norm", "resumed at 4"}
    figure.canvas.draw()
    labels = [t.get_text() for axes in figure.axes for t in axes.get_yticklabels()]
    assert labels and not any("times" in label or "^" in label for label in labels)

    from matplotlib.image import imread

    height, width = imread(tmp_path / "out" / "metrics.png").shape[:2]
    assert (width, height) == tuple(round(v * 100) for v in figure.get_size_inches())


def write_metrics(path: Path, records: Sequence[Mapping[str, object]]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_keys_choose_the_panels_from_the_cli(tmp_path: Path) -> None:
    run = write_metrics(
        tmp_path / "run",
        [
            {"step": s, "loss": 1.0 / s, "lr": 0.1, "lr/group1": 0.2, "mine/grad_max": s}
            for s in (1, 2, 3)
        ],
    )
    done = run_cli(
        "plot", "run", "--keys", "loss,mine/grad_max", "lr", "--out", "k.png", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "k.png").read_bytes().startswith(PNG_MAGIC)
    figure = draw_run(run, keys=["loss,mine/grad_max", "lr"])
    assert [axes.get_title() for axes in figure.axes] == ["loss, mine/grad_max", "lr"]
    assert set(lines_of(figure.axes[0])) == {"loss", "mine/grad_max"}
    assert set(lines_of(figure.axes[1])) == {"lr", "lr/group1"}  # a key includes those under it
    wrong = run_cli("plot", "run", "--keys", "mine/grad_mux", cwd=tmp_path)
    assert wrong.returncode == 2
    assert wrong.stderr.startswith(
        "speedtronic: error: key 'mine/grad_mux' was not logged (as a number) in this run: "
        "did you mean 'mine/grad_max'? logged: loss, lr, lr/group1, mine/grad_max"
    )


def test_every_logged_key_gets_a_panel_up_to_a_limit(tmp_path: Path) -> None:
    keys = [f"mine/k{i:02d}" for i in range(MAX_EXTRA_PANELS + 2)]
    run = write_metrics(
        tmp_path, [{"step": s, "loss": 2.0, "samples": s, **dict.fromkeys(keys, s)} for s in (1, 2)]
    )
    figure = draw_run(run)
    titles = [axes.get_title() for axes in figure.axes]
    assert titles == ["loss", "learning rate", "steps/s", *keys[:MAX_EXTRA_PANELS]]
    assert figure.get_suptitle().endswith("(2 more keys were logged: choose them with --keys)")


def test_a_loss_over_decades_is_log_scale_with_plain_labels(tmp_path: Path) -> None:
    records = [{"step": s, "loss": 10.0 / s, "elapsed_s": 0.1 * s} for s in range(1, 201)]
    figure = draw_run(write_metrics(tmp_path, records))
    loss = figure.axes[0]
    figure.canvas.draw()
    assert loss.get_yscale() == "log"
    labels = {t.get_text() for t in loss.get_yticklabels() if t.get_text()}
    assert {"0.1", "1", "10"} <= labels  # not 10^0 or 6x10^0
    assert not any("\\" in label or "$" in label for label in labels)
    within_a_decade = draw_run(write_metrics(tmp_path / "flat", records[:5]))
    assert within_a_decade.axes[0].get_yscale() == "linear"


def test_a_resume_is_found_where_the_fit_start_changes_whatever_the_clock(
    tmp_path: Path,
) -> None:
    """A short resumed fit can log a larger ``elapsed_s`` than the fit before it (its first
    steps pay one-off costs): the resume is found by the start step read back from the rate;
    records without a rate fall back to the clock starting again."""

    def record(step: int, start: int, elapsed: float) -> dict[str, float]:
        return {"step": step, "loss": 1.0, "elapsed_s": elapsed,
                "steps_per_sec": (step - start) / elapsed}  # fmt: skip

    path = tmp_path / "metrics.jsonl"
    rows = [record(2, 0, 0.1), record(4, 0, 0.2), record(6, 4, 0.5), record(8, 4, 0.6)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert load_series(path).resumed_at == [4]
    clock_only = [{"step": s, "loss": 1.0, "elapsed_s": e} for s, e in ((2, 1), (4, 2), (6, 1))]
    path.write_text("".join(json.dumps(row) + "\n" for row in clock_only))
    assert load_series(path).resumed_at == [4]
