"""The text, JSONL, CSV and progress sinks, system metrics, failure isolation, and the
original ``MetricLogger`` hook API."""

from __future__ import annotations

import csv
import io
import json
import math
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path

import jsonschema
import pytest
import torch
from sink_helpers import (
    StateAtStep,
    TinyRegressor,
    make_trainer,
    plugin_context,
    read_jsonl,
)

from speedtronic import Trainer
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import MetricsContext, StepContext
from speedtronic.engine.dispatch import CallbackWarning
from speedtronic.engine.metrics import MetricRecord
from speedtronic.hooks import on_event
from speedtronic.profiling import (
    CallbackList,
    MetricLogger,
    MetricLoggerCallback,
    Payload,
    memory_usage_bytes,
)
from speedtronic_callbacks.console import ConsoleCallback
from speedtronic_callbacks.csv_sink import CsvCallback
from speedtronic_callbacks.early_stopping import EarlyStopping
from speedtronic_callbacks.jsonl import JsonlCallback, encode_record
from speedtronic_callbacks.nan_guard import NanGuard
from speedtronic_callbacks.progress import ProgressBarCallback
from speedtronic_callbacks.sink import MetricSink, Record, format_si
from speedtronic_callbacks.system_metrics import SystemMetricsCallback
from speedtronic_callbacks.tensorboard import TensorBoardCallback
from speedtronic_callbacks.wandb import WandbCallback

PLUGINS: list[type[Callback]] = [
    ConsoleCallback,
    JsonlCallback,
    CsvCallback,
    ProgressBarCallback,
    TensorBoardCallback,
    WandbCallback,
    SystemMetricsCallback,
    EarlyStopping,
    NanGuard,
]


# -- plugin contract ----------------------------------------------------------------------


@pytest.mark.parametrize("plugin", PLUGINS, ids=lambda cls: cls.__name__)
def test_options_schema_is_a_closed_valid_schema(plugin: type[Callback]) -> None:
    jsonschema.Draft202012Validator.check_schema(dict(plugin.options_schema))
    assert plugin.options_schema["additionalProperties"] is False
    assert plugin.plugin_name is not None
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"no_such_option": 1}, dict(plugin.options_schema))


@pytest.mark.parametrize("plugin", PLUGINS, ids=lambda cls: cls.__name__)
def test_from_options_builds_with_defaults(plugin: type[Callback], tmp_path: Path) -> None:
    callback = plugin.from_options({}, plugin_context(tmp_path))
    assert isinstance(callback, plugin)


FULL_OPTIONS: dict[type[Callback], dict[str, object]] = {
    ConsoleCallback: {"file": "log.txt", "stream": "stderr", "keys": ["grad_norm"]},
    JsonlCallback: {"path": "m.jsonl"},
    CsvCallback: {"path": "m.csv"},
    ProgressBarCallback: {"mode": "lines", "stream": "stderr", "min_interval_s": 2, "leave": False},
    TensorBoardCallback: {
        "log_dir": "tb",
        "prefix": "train/",
        "flush_secs": 5,
        "log_config": False,
    },
    WandbCallback: {
        "project": "p",
        "entity": None,
        "name": "n",
        "group": "g",
        "tags": ["a"],
        "notes": None,
        "mode": "disabled",
        "dir": "w",
        "id": "abc123",
        "log_config": False,
        "background": False,
    },
    SystemMetricsCallback: {"memory": False, "mfu": True, "peak_flops": 1e12},
    EarlyStopping: {
        "monitor": "acc",
        "mode": "max",
        "patience": 4,
        "min_delta": 0.5,
        "stop_on_non_finite": False,
    },
    NanGuard: {
        "action": "skip",
        "check_every": 3,
        "check_grads": False,
        "max_consecutive_skips": 2,
    },
}


@pytest.mark.parametrize("plugin", PLUGINS, ids=lambda cls: cls.__name__)
def test_every_option_validates_and_reaches_the_callback(
    plugin: type[Callback], tmp_path: Path
) -> None:
    options = FULL_OPTIONS[plugin]
    jsonschema.validate(options, dict(plugin.options_schema))
    callback = plugin.from_options(options, plugin_context(tmp_path))
    attributes = {
        ConsoleCallback: ("stream_name", "stderr"),
        JsonlCallback: ("path", tmp_path / "m.jsonl"),
        CsvCallback: ("path", tmp_path / "m.csv"),
        ProgressBarCallback: ("min_interval_s", 2.0),
        TensorBoardCallback: ("prefix", "train/"),
        WandbCallback: ("run_id", "abc123"),
        SystemMetricsCallback: ("peak_flops", 1e12),
        EarlyStopping: ("min_delta", 0.5),
        NanGuard: ("check_every", 3),
    }
    name, expected = attributes[plugin]
    assert getattr(callback, name) == expected


def test_relative_paths_resolve_under_the_output_dir(tmp_path: Path) -> None:
    context = plugin_context(tmp_path, {"logging": {"file": "train.log"}})
    assert JsonlCallback.from_options({}, context).path == tmp_path / "metrics.jsonl"
    assert CsvCallback.from_options({"path": "m/x.csv"}, context).path == tmp_path / "m/x.csv"
    # logging.file reaches the console's options through the plugin's 2.0 rewrite.
    legacy = context.config.to_dict()
    with_file = ConsoleCallback.options_from_legacy(legacy, {})
    assert with_file is not None
    assert ConsoleCallback.from_options(with_file, context).file == tmp_path / "train.log"
    without_file = ConsoleCallback.options_from_legacy(legacy, {"file": None})
    assert without_file is not None
    assert ConsoleCallback.from_options(without_file, context).file is None
    tensorboard = TensorBoardCallback.from_options({}, context)
    assert tensorboard.log_dir == tmp_path / "tensorboard"
    absolute = tmp_path / "elsewhere.jsonl"
    assert JsonlCallback.from_options({"path": str(absolute)}, context).path == absolute


# -- JSONL ------------------------------------------------------------------------------


class FileProbe(Callback):
    """Reads the JSONL file at every step end: what a tail -f would see mid-fit."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: list[list[int]] = []

    def on_step_end(self, trainer: Trainer, ctx: StepContext) -> None:
        steps = [int(str(r["step"])) for r in read_jsonl(self.path)]
        self.seen.append(steps)


def test_jsonl_writes_one_flushed_line_per_due_record(tmp_path: Path) -> None:
    probe = FileProbe(tmp_path / "metrics.jsonl")
    trainer = make_trainer(tmp_path, [JsonlCallback(), probe], max_steps=5, metrics_every=2)
    result = trainer.fit()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [2, 4, 5]  # cadence plus the final step
    assert records == result.metrics
    expected_keys = {"step", "loss", "lr", "steps_per_sec", "samples_per_sec"}
    assert expected_keys | {"tokens_per_sec", "samples", "tokens", "elapsed_s"} <= set(records[0])
    # Flushed as written: readable by another reader before the fit ends.
    assert probe.seen[1] == [2] and probe.seen[3] == [2, 4]


def test_jsonl_resume_keeps_steps_contiguous_without_duplicates(tmp_path: Path) -> None:
    snapshot = StateAtStep(4)
    first = make_trainer(tmp_path, [JsonlCallback(), snapshot], max_steps=6)
    first_result = first.fit()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert snapshot.state is not None

    resumed_sink = JsonlCallback()
    resumed = make_trainer(tmp_path, [resumed_sink], max_steps=8)
    resumed.load_state_dict(snapshot.state)
    with pytest.warns(UserWarning, match="removed 2 line"):
        resumed.fit()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 9))
    assert resumed_sink.dropped_on_resume == 2
    # Exact resume: the re-run steps 5 and 6 reproduce the first run's losses.
    assert [r["loss"] for r in records[4:6]] == [r["loss"] for r in first_result.metrics[4:6]]


def test_jsonl_drops_a_torn_last_line_and_writes_strict_json(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo', encoding="utf-8")
    sink = JsonlCallback()
    trainer = make_trainer(tmp_path, [sink], max_steps=3)
    trainer.step = 1  # as if resumed from a checkpoint of step 1
    with pytest.warns(UserWarning, match="removed 1 line"):
        trainer.fit()
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]
    assert encode_record({"step": 1, "loss": math.nan, "x": math.inf}) == (
        '{"step":1,"loss":null,"x":null}'
    )


def test_fresh_fit_starts_a_new_jsonl_file(tmp_path: Path) -> None:
    make_trainer(tmp_path, [JsonlCallback()], max_steps=4).fit()
    with pytest.warns(UserWarning, match="kept them as metrics.1.jsonl"):
        make_trainer(tmp_path, [JsonlCallback()], max_steps=2).fit()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.1.jsonl")] == [1, 2, 3, 4]


# -- CSV --------------------------------------------------------------------------------


class LateKey(Callback):
    """Adds ``extra`` to records from step ``start`` on (a key that appears mid-run)."""

    def __init__(self, start: int) -> None:
        self.start = start

    def on_metrics(self, trainer: Trainer, ctx: MetricsContext) -> None:
        if ctx.step >= self.start:
            ctx.record.set("extra", float(ctx.step))


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(encoding="utf-8", newline="") as handle:
        return list(csv.DictReader(handle))


def test_csv_rows_widen_for_new_keys_and_survive_resume(tmp_path: Path) -> None:
    snapshot = StateAtStep(3)
    sink = CsvCallback()
    make_trainer(tmp_path, [LateKey(start=3), sink, snapshot], max_steps=5).fit()
    assert sink.closed
    rows = read_csv(tmp_path / "metrics.csv")
    assert [row["step"] for row in rows] == ["1", "2", "3", "4", "5"]
    assert [row["extra"] for row in rows] == ["", "", "3.0", "4.0", "5.0"]
    assert float(rows[0]["loss"]) > 0

    assert snapshot.state is not None
    resumed = make_trainer(tmp_path, [LateKey(start=3), CsvCallback()], max_steps=6)
    resumed.load_state_dict(snapshot.state)
    resumed.fit()
    rows = read_csv(tmp_path / "metrics.csv")
    assert [row["step"] for row in rows] == ["1", "2", "3", "4", "5", "6"]
    assert rows[-1]["extra"] == "6.0"


class KeyPerStep(Callback):
    """Adds a key of its own on every step (``k<step>``), and ``odd`` on odd steps only."""

    def on_metrics(self, trainer: Trainer, ctx: MetricsContext) -> None:
        ctx.record.set(f"k{ctx.step}", float(ctx.step))
        if ctx.step % 2:
            ctx.record.set("odd", ctx.step)


class CsvStaysATable(Callback):
    """At every step end, the CSV parses as one table: a row per step so far, every row as
    wide as the header."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_step_end(self, trainer: Trainer, ctx: StepContext) -> None:
        with self.path.open(encoding="utf-8", newline="") as handle:
            header, *rows = list(csv.reader(handle))
        assert len(rows) == ctx.step
        assert {len(row) for row in rows} == {len(header)}
        assert [row[header.index("step")] for row in rows] == [str(s + 1) for s in range(ctx.step)]


@pytest.mark.parametrize("floor", [0, CsvCallback.REWRITE_FLOOR_BYTES])
def test_csv_widening_writes_linear_bytes_and_keeps_every_cell(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, floor: int
) -> None:
    import speedtronic_callbacks.csv_sink as csv_sink

    rewrites: list[int] = []  # bytes of every whole-file write the sink makes
    original = csv_sink.atomic_write_text

    def counted(path: Path, text: str) -> None:
        rewrites.append(len(text.encode("utf-8")))
        original(path, text)

    monkeypatch.setattr(csv_sink, "atomic_write_text", counted)
    monkeypatch.setattr(CsvCallback, "REWRITE_FLOOR_BYTES", floor)
    steps, table = 120, tmp_path / "metrics.csv"
    sink = CsvCallback()
    callbacks = [KeyPerStep(), sink, JsonlCallback(), CsvStaysATable(table)]
    make_trainer(tmp_path, callbacks, max_steps=steps).fit()

    # every cell of every record is in the file once the fit ends, as in metrics.jsonl
    rows, records = read_csv(table), read_jsonl(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in rows] == [str(record["step"]) for record in records]
    for row, record in zip(rows, records, strict=True):
        assert {key: value for key, value in row.items() if value} == {
            key: str(value) for key, value in record.items()
        }
    # a new key on every step: rewrites stay within the budget, a few whole files, not one
    # file per step (which is what makes the cost quadratic)
    size = table.stat().st_size
    assert sum(rewrites) == sink.rewritten_bytes + rewrites[0]  # the first is the header
    assert sink.rewritten_bytes <= (CsvCallback.REWRITE_BUDGET + 1) * size + floor
    assert len(rewrites) < (steps if floor else 20)


# -- console ----------------------------------------------------------------------------


def test_console_writes_start_step_and_summary_lines(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "train.log"
    sink = ConsoleCallback(file=log)
    make_trainer(tmp_path, [sink], max_steps=4, metrics_every=2).fit()
    assert sink.closed
    lines = log.read_text(encoding="utf-8").splitlines()
    threads = torch.get_num_threads()
    assert lines[0].startswith(
        f"fit start: step 0 -> 4 | device cpu | threads {threads} | precision fp32"
    )
    summary = [line for line in lines if line.startswith("  ")]
    assert summary[0].split() == ["module", "type", "params", "trainable", "dtype"]
    assert summary[-1].split()[0] == "total" and lines[1 : 1 + len(summary)] == summary
    lines = [lines[0], *lines[1 + len(summary) :]]
    assert lines[1].startswith("step 2/4 | loss ")
    assert " | lr 5.00e-02 | " in lines[1] and "steps/s" in lines[1] and "tok/s" in lines[1]
    assert lines[2].startswith("step 4/4 | loss ")
    assert lines[3].startswith("fit end: 4 steps in ") and "final loss" in lines[3]
    assert len(lines) == 4


def test_console_prints_to_stdout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_trainer(tmp_path, [ConsoleCallback(summary=False)], max_steps=2).fit()
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" |")[0] for line in out] == [
        "fit start: step 0 -> 2",
        "step 1/2",
        "step 2/2",
        "fit end: 2 steps in 0:00",
    ]


# -- progress ---------------------------------------------------------------------------


def test_progress_without_a_tty_prints_plain_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bar = ProgressBarCallback()
    make_trainer(tmp_path, [bar], max_steps=4, metrics_every=2).fit()
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("step 2/4 (50%) | loss ")
    assert "| lr 5.00e-02 |" in lines[0] and "| eta " in lines[0]
    assert lines[1].startswith("step 4/4 (100%) | loss ")
    assert "\r" not in captured.out and "\x1b" not in captured.out
    assert captured.err == ""
    assert not bar.uses_bar


def test_progress_lines_respect_min_interval(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_trainer(tmp_path, [ProgressBarCallback(min_interval_s=3600)], max_steps=5).fit()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" (")[0] for line in lines] == ["step 1/5", "step 5/5"]


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_a_tqdm_bar_on_a_terminal(tmp_path: Path) -> None:
    terminal = FakeTerminal()
    bar = ProgressBarCallback(stream=terminal)
    make_trainer(tmp_path, [bar], max_steps=3).fit()
    drawn = terminal.getvalue()
    assert "train:" in drawn and "3/3" in drawn and "loss=" in drawn and "\r" in drawn
    assert not bar.uses_bar  # closed at fit end


def test_console_lines_and_bar_do_not_tear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    bar = ProgressBarCallback()
    make_trainer(tmp_path, [bar, ConsoleCallback()], max_steps=2).fit()
    # tqdm.write clears the bar ("\r   \r") before each console line, so every console line
    # is a segment of its own, never glued to bar output.
    segments = [s.strip() for s in terminal.getvalue().replace("\r", "\n").splitlines()]
    console_lines = [s for s in segments if "| loss " in s and "train:" not in s]
    assert [line.split(" |")[0] for line in console_lines] == ["step 1/2", "step 2/2"]
    assert any(s.startswith("train:") for s in segments)


# -- system metrics ---------------------------------------------------------------------


class FlopsCountingRegressor(TinyRegressor):
    def flops_per_token(self, seq_len: int | None = None) -> int:
        return 6 * 5 * (seq_len or 1)


def test_system_metrics_adds_flops_and_mfu_but_no_cpu_memory(tmp_path: Path) -> None:
    sink = JsonlCallback()
    metrics = SystemMetricsCallback(peak_flops=1e9)
    trainer = make_trainer(tmp_path, [metrics, sink], model=FlopsCountingRegressor())
    trainer.fit()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    for record in records:
        assert "memory_bytes" not in record  # CPU reports no device memory
        flops = float(str(record["flops_per_sec"]))
        assert flops > 0
        assert float(str(record["mfu"])) == pytest.approx(flops / 1e9)
    assert memory_usage_bytes("cpu") is None


def test_system_metrics_leaves_models_without_flop_counts_alone(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [SystemMetricsCallback(peak_flops=1e9)])
    with pytest.warns(UserWarning, match=r"no flops_per_sec or mfu: the model has no flops_per"):
        record = trainer.fit().metrics[-1]
    assert "mfu" not in record and "flops_per_sec" not in record


# -- failure isolation and sync discipline ----------------------------------------------


class BrokenSink(MetricSink):
    plugin_name = "broken"

    def __init__(self) -> None:
        self.calls = 0

    def write_record(self, trainer: Trainer, record: Record) -> None:
        self.calls += 1
        raise OSError("disk full")


def test_a_failing_sink_warns_once_and_training_continues(tmp_path: Path) -> None:
    broken = BrokenSink()
    jsonl = JsonlCallback()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = make_trainer(tmp_path, [broken, jsonl], max_steps=5).fit()
    assert result.steps == 5
    assert broken.calls == 5
    reports = [w for w in caught if issubclass(w.category, CallbackWarning)]
    assert len(reports) == 1
    message = str(reports[0].message)
    assert "'broken'" in message and "'metrics'" in message and "disk full" in message
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 5  # other sinks unaffected


@pytest.mark.filterwarnings("ignore:system_metrics. no flops_per_sec:UserWarning")
def test_sinks_materialise_records_only_on_due_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    materialised: list[int] = []
    original = MetricRecord.finished  # values() and every sink read the record through it

    def counting_finished(self: MetricRecord) -> Mapping[str, float | int | str]:
        if self._pending:  # a host transfer happens only while tensors are pending
            materialised.append(self.step)
        return original(self)

    monkeypatch.setattr(MetricRecord, "finished", counting_finished)
    sinks: list[Callback] = [
        SystemMetricsCallback(),
        ConsoleCallback(file=tmp_path / "log.txt"),
        JsonlCallback(),
        CsvCallback(),
        ProgressBarCallback(),
        TensorBoardCallback(),
    ]
    make_trainer(tmp_path, sinks, max_steps=7, metrics_every=3).fit()
    assert materialised == [3, 6, 7]


def test_every_sink_is_closed_when_the_fit_fails(tmp_path: Path) -> None:
    class Boom(Callback):
        def on_step_end(self, trainer: Trainer, ctx: StepContext) -> None:
            if ctx.step == 2:
                raise ValueError("model exploded")

    console = ConsoleCallback(file=tmp_path / "log.txt")
    sinks = [console, JsonlCallback(), CsvCallback(), TensorBoardCallback()]
    with pytest.raises(ValueError, match="model exploded"):
        make_trainer(tmp_path, [*sinks, Boom()], max_steps=5).fit()
    assert all(sink.closed for sink in sinks)
    last = (tmp_path / "log.txt").read_text(encoding="utf-8").splitlines()[-1]
    assert last == "fit failed after step 2: ValueError: model exploded"


# -- the original MetricLogger API ------------------------------------------------------


class RecordingHook:
    def __init__(self) -> None:
        self.events: list[tuple[str, Payload]] = []

    def on_event(self, event: str, payload: Payload) -> None:
        self.events.append((event, payload))


def test_metric_logger_writes_text_json_and_calls_hooks(tmp_path: Path) -> None:
    stream = io.StringIO()
    hook = RecordingHook()
    seen: list[str] = []
    logger = MetricLogger(
        stream=stream,
        json_file=tmp_path / "events.jsonl",
        every_steps=2,
        hooks=[hook, lambda event, payload: seen.append(event)],
    )
    logger.emit("train_start", {"start_step": 0})
    logger.emit("train_step", {"step": 1, "loss": 1.5})
    logger.emit("train_step", {"step": 2, "loss": 1.25})
    logger.info("plain %s", "message")
    logger.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3
    assert " | INFO | train_start start_step=0 elapsed_s=" in lines[0]
    assert " | INFO | train_step step=2 loss=1.25 elapsed_s=" in lines[1]
    assert lines[2].endswith(" | INFO | plain message")
    events = read_jsonl(tmp_path / "events.jsonl")
    assert [(e["event"], e.get("step")) for e in events] == [
        ("train_start", None),
        ("train_step", 2),
    ]
    assert [event for event, _ in hook.events] == ["train_start", "train_step"] == seen
    assert hook.events[1][1]["loss"] == 1.25 and "elapsed_s" in hook.events[1][1]


def test_metric_logger_reports_a_failing_hook_once(tmp_path: Path) -> None:
    stream = io.StringIO()
    calls: list[str] = []

    def failing(event: str, payload: Payload) -> None:
        calls.append(event)
        raise RuntimeError("tracker offline")

    logger = MetricLogger(stream=stream, hooks=[failing])
    for step in range(1, 4):
        logger.emit("train_step", {"step": step})
    logger.close()
    warnings_logged = [line for line in stream.getvalue().splitlines() if "| WARNING |" in line]
    assert len(calls) == 3
    assert len(warnings_logged) == 1
    assert "failing" in warnings_logged[0] and "tracker offline" in warnings_logged[0]


def test_hook_wrappers_and_callback_list() -> None:
    hook = RecordingHook()
    wrapped = on_event(hook)
    wrapped("train_end", {"steps": 3})
    fan_out = CallbackList([hook, on_event(lambda event, payload: None)])
    fan_out.on_event("checkpoint", {"step": 3, "path": "x"})
    assert [event for event, _ in hook.events] == ["train_end", "checkpoint"]


def test_metric_logger_callback_emits_the_original_events(tmp_path: Path) -> None:
    from speedtronic_callbacks.checkpoint import CheckpointCallback

    hook = RecordingHook()
    logger = MetricLogger(stream=io.StringIO(), hooks=[hook])
    adapter = MetricLoggerCallback(logger, close_logger=True)
    saver = CheckpointCallback(tmp_path / "ckpt", every_steps=2, save_on_signal=False)
    make_trainer(tmp_path, [saver, adapter], max_steps=3, metrics_every=1).fit()
    names = [event for event, _ in hook.events]
    assert names == [
        "train_start",
        "train_step",
        "train_step",
        "checkpoint",
        "train_step",
        "train_end",
        "checkpoint",
    ]
    start = hook.events[0][1]
    assert start["start_step"] == 0 and start["target_step"] == 3 and start["device"] == "cpu"
    checkpoints = [payload for event, payload in hook.events if event == "checkpoint"]
    assert [p["step"] for p in checkpoints] == [2, 3]
    assert all(Path(str(p["path"])).exists() for p in checkpoints)
    end = hook.events[5][1]
    assert end["steps"] == 3 and isinstance(end["loss"], float)
    assert json.dumps(hook.events[1][1])  # payloads are plain values


def test_memory_usage_bytes_is_none_without_an_accelerator() -> None:
    if not torch.cuda.is_available() and not torch.backends.mps.is_available():
        assert memory_usage_bytes() is None
    assert memory_usage_bytes(torch.device("cpu")) is None


@pytest.mark.parametrize("sink", ["jsonl", "csv"])
def test_a_fresh_trainer_keeps_an_earlier_runs_metrics_file(tmp_path: Path, sink: str) -> None:
    # The CLI refuses a used run directory; a Trainer built in Python must not truncate
    # another run's records either: they are kept under a new name, with a warning.
    from speedtronic_callbacks.csv_sink import CsvCallback
    from speedtronic_callbacks.jsonl import JsonlCallback

    name = "metrics.jsonl" if sink == "jsonl" else "metrics.csv"

    def fresh_run() -> None:
        model = torch.nn.Linear(2, 1)
        callback = JsonlCallback(name) if sink == "jsonl" else CsvCallback(name)
        Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            [torch.ones(4, 2)],
            callbacks=[callback],
            max_steps=3,
            metrics_every=1,
            output_dir=tmp_path,
        ).fit()

    fresh_run()
    first = (tmp_path / name).read_text()
    with pytest.warns(UserWarning, match=r"earlier run's records; kept them as metrics\.1\."):
        fresh_run()
    kept = tmp_path / name.replace("metrics.", "metrics.1.")
    assert kept.read_text() == first  # the first run's records, untouched
    assert (tmp_path / name).read_text().count("\n") == first.count("\n")  # a full new file
    with pytest.warns(UserWarning, match=r"kept them as metrics\.2\."):
        fresh_run()
    assert kept.read_text() == first


def test_a_record_reads_host_tensors_as_float32_values_like_device_ones() -> None:
    """Host tensors are read one by one, device ones stacked: either way a value is its
    tensor's float32 value as a Python float, whatever the tensor's dtype or shape."""
    record = MetricRecord(4)
    record.set("loss", torch.tensor(1.1, dtype=torch.float32))
    record.set("wide", torch.tensor([1 / 3], dtype=torch.float64))
    record.set("count", torch.tensor((1 << 24) + 1))
    record.set("lr", 0.5)
    values = record.values()
    assert values == {
        "step": 4,
        "lr": 0.5,
        "loss": float(torch.tensor(1.1).item()),
        "wide": float(torch.tensor(1 / 3, dtype=torch.float32).item()),
        "count": float(1 << 24),  # float32 rounds 2**24 + 1 down, as the stacked read does
    }
    assert all(type(values[key]) is float for key in ("loss", "wide", "count"))
    stacked = torch.stack([torch.tensor(v).reshape(()).float() for v in (1.1, 1 / 3)]).tolist()
    assert [values["loss"], values["wide"]] == stacked
    record.set("loss", 2.0)  # a plain value replaces a tensor under the same key
    assert record.values()["loss"] == 2.0


def test_the_sinks_of_one_event_share_a_finished_record_and_the_loop_gets_its_own() -> None:
    """``finished()`` is one mapping for every reader until the next ``set`` (the sinks of
    a ``metrics`` event share it); ``values()`` is a new dict its caller may change."""
    weight = torch.tensor(2.0, requires_grad=True)
    loss = weight * 3
    record = MetricRecord(5)
    record.set("loss", loss)  # a tensor with autograd history is kept detached
    record.set("lr", 0.1)
    first = record.finished()
    assert record.finished() is first
    assert dict(first) == {"step": 5, "loss": 6.0, "lr": 0.1}
    own = record.values()
    assert own == first and own is not first
    own["lr"] = 9.0
    assert record.finished()["lr"] == 0.1  # a caller's copy never reaches the sinks
    record.set("mine/x", 1)
    after = record.finished()
    assert after is not first and after["mine/x"] == 1
    assert "mine/x" not in first  # a mapping handed out earlier does not change
    assert loss.grad_fn is not None and loss.requires_grad  # the caller's tensor untouched
    record.set("flag", True)  # other plain values stay what they are
    record.set("note", "warmup")
    record.set("weight", torch.nn.Parameter(torch.tensor(0.5)))  # a tensor subclass
    assert {k: record.finished()[k] for k in ("flag", "note", "weight")} == {
        "flag": True,
        "note": "warmup",
        "weight": 0.5,
    }
    assert type(record.finished()["flag"]) is bool


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0.0, "0"),
        (12.5, "12.5"),
        (12.0, "12"),
        (150.5, "150"),  # three digits: no decimals (banker's rounding of .5)
        (999.4, "999"),
        (1000.0, "1.0k"),
        (-1234.5, "-1.2k"),
        (999_999.0, "1000.0k"),
        (2.5e6, "2.5M"),
        (7.25e9, "7.2G"),
        (3e15, "3000.0T"),
        (float("nan"), "nan"),
    ],
)
def test_format_si_picks_the_unit_by_magnitude(value: float, text: str) -> None:
    assert format_si(value) == text
