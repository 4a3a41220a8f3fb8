"""Issue 26, item 1: wall-clock budgets (``run.max_time``, ``--max-time``) and saves by wall
clock (``checkpoint.every_minutes``).

A run with a budget stops after the step during which the budget runs out, leaves a final
checkpoint (also with ``save_final: false``) and ``speedtronic fit`` exits 75 for a requeue;
the resumed job gets a fresh budget. Steps are slowed by a callback that sleeps, so that the
stop and the timed saves land at steps whose end times the tests record and check.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
import yaml
from cli_runner import run_cli
from forked import Forked
from test_checkpoint import saved_steps, tiny_trainer
from test_distributed import launch, succeeded
from test_hardening import CLI_CONFIG

from speedtronic.config import ConfigError, SpeedtronicConfig
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import StepContext
from speedtronic.engine.trainer import Trainer
from speedtronic.runtime import callback_specs
from speedtronic.state.checkpoint import requeue_exit_code
from speedtronic.state.time_budget import (
    TIME_BUDGET_EXIT_CODE,
    DurationError,
    describe_duration,
    is_time_budget_stop,
    parse_duration,
    time_budget_stop_reason,
)
from speedtronic_callbacks.checkpoint import CheckpointCallback
from speedtronic_callbacks.time_budget import TimeBudget
from speedtronic_callbacks.wall_clock import Deadline


class SlowSteps(Callback):
    """Makes every step take at least ``seconds`` and records when each one ended."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.ended: dict[int, float] = {}

    def on_step_start(self, trainer: Trainer, ctx: StepContext) -> None:
        time.sleep(self.seconds)

    def on_step_end(self, trainer: Trainer, ctx: StepContext) -> None:
        self.ended[ctx.step] = time.monotonic()


# -- durations ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (90, 90.0),
        (2.5, 2.5),
        ("90", 90.0),
        ("90s", 90.0),
        ("45m", 2700.0),
        ("3h50m", 13800.0),
        ("1d2h", 93600.0),
        ("1.5h", 5400.0),
        ("2h 30m", 9000.0),
        ("03:50:00", 13800.0),
        ("50:00", 3000.0),
        ("1-02:00:00", 93600.0),
        ("1-02", 93600.0),
        ("1-02:30", 95400.0),
        ("3H50M", 13800.0),
    ],
)
def test_durations_in_the_forms_people_and_slurm_write(value: object, seconds: float) -> None:
    assert parse_duration(value) == seconds


@pytest.mark.parametrize(
    "value",
    [
        "",
        "3hh",
        "h",
        "50m3h",
        "1:2:3:4",
        "10:60",
        "-5",
        "0",
        0,
        -1.0,
        float("nan"),
        True,
        None,
        "1" * 100,
        10**12,
        [60],
    ],
)
def test_what_is_not_a_duration_says_which_forms_are(value: object) -> None:
    with pytest.raises(DurationError, match=r"90s, 45m, 3h50m, 1d2h, 03:50:00"):
        parse_duration(value)


def test_the_stop_reason_names_the_budget_and_maps_to_the_requeue_code() -> None:
    assert describe_duration(13800.0) == "3h50m"
    assert describe_duration(90.0) == "1m30s"
    assert describe_duration(1.25) == "1.25s"
    reason = time_budget_stop_reason(13800.0)
    assert reason == "time budget 3h50m spent" and is_time_budget_stop(reason)
    assert requeue_exit_code(reason) == TIME_BUDGET_EXIT_CODE == 75
    assert requeue_exit_code("signal SIGTERM") == 143  # unchanged
    assert not is_time_budget_stop("signal SIGTERM") and not is_time_budget_stop(None)


# -- config ---------------------------------------------------------------------------------


def test_run_max_time_adds_the_time_budget_plugin_and_only_then() -> None:
    assert "time_budget" not in [spec.name for spec in callback_specs(SpeedtronicConfig())]
    config = SpeedtronicConfig.from_dict({"run": {"max_time": "3h50m"}})
    specs = {spec.name: spec.options for spec in callback_specs(config)}
    assert specs["time_budget"] == {"max_time": "3h50m"}
    # YAML reads an unquoted 3:50:00 as 13800 (base 60): the same budget
    config = SpeedtronicConfig.from_dict(yaml.safe_load("run: {max_time: 3:50:00}"))
    assert {spec.name: spec.options for spec in callback_specs(config)}["time_budget"] == {
        "max_time": 13800
    }


def test_a_bad_or_too_short_max_time_is_one_config_error_naming_it() -> None:
    with pytest.raises(ConfigError) as bad:
        SpeedtronicConfig.from_dict({"run": {"max_time": "3hh"}})
    assert str(bad.value).count("run.max_time") == 1
    assert "'3hh' is not a duration: write it like 90s" in str(bad.value)
    with pytest.raises(ConfigError, match=r"run.max_time: 0.5 is shorter than one second"):
        SpeedtronicConfig.from_dict({"run": {"max_time": 0.5}})
    with pytest.raises(ConfigError, match=r"callbacks\[0\].max_time: '2x' is not a duration"):
        SpeedtronicConfig.from_dict({"callbacks": [{"name": "time_budget", "max_time": "2x"}]})


def test_cli_max_time_that_is_not_a_duration_exits_2(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(CLI_CONFIG))
    for value, words in (("soon", "'soon' is not a duration"), ("0.2s", "shorter than one")):
        result = run_cli("fit", "--config", str(config), "--max-time", value, cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        assert f"speedtronic: error: --max-time {value!r}" in result.stderr
        assert words in result.stderr and "Traceback" not in result.stderr
    checked = run_cli("validate", "--config", str(config), "--max-time", "3h50m", cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert "max_time: 3h50m" in checked.stdout and "time_budget" in checked.stdout


# -- stopping -------------------------------------------------------------------------------


def test_the_fit_stops_after_the_step_during_which_the_budget_runs_out(tmp_path: Path) -> None:
    slow = SlowSteps(0.04)
    checkpoint = CheckpointCallback(tmp_path / "ck", every_steps=10**6, save_final=False)
    budget = TimeBudget(1, started_at=time.monotonic() - 0.6)
    trainer = tiny_trainer([slow, checkpoint, budget], k=1)
    result = trainer.fit(10**6)
    stop = result.steps
    assert result.stop_reason == "time budget 1s spent" and budget.stopped_at_step == stop
    # the step during which the budget ran out: the one before it ended in time
    assert slow.ended[stop] >= budget.deadline > slow.ended[stop - 1]
    assert stop >= 2
    # a final checkpoint although save_final is false, of the last step
    assert saved_steps(tmp_path / "ck") == [stop]


def test_a_budget_shorter_than_one_step_trains_one_step_and_says_so(tmp_path: Path) -> None:
    checkpoint = CheckpointCallback(tmp_path / "ck", every_steps=10**6)
    budget = TimeBudget(1, started_at=time.monotonic() - 5)  # already spent at the start
    trainer = tiny_trainer([checkpoint, budget], k=1)
    trainer.step = 4  # as after a resume: the fit's first step is 5
    with pytest.warns(
        UserWarning,
        match=r"time budget 1s is shorter than one step: it was "
        r"spent when the first step of this fit \(step 5\) ended",
    ):
        result = trainer.fit(100)
    assert result.steps == 5 and is_time_budget_stop(result.stop_reason)
    assert saved_steps(tmp_path / "ck") == [5]


def time_budget_config(tmp_path: Path, **checkpoint: object) -> Path:
    path = tmp_path / "run.yaml"
    config = {
        **CLI_CONFIG,
        "run": {**CLI_CONFIG["run"], "max_steps": 10**9},
        "checkpoint": {"every_steps": 10**6, "keep_last": 2, **checkpoint},
        "callbacks": [{"name": "checkpoint", "save_final": False}],
    }
    path.write_text(yaml.safe_dump(config))
    return path


def test_speedtronic_fit_exits_75_with_a_checkpoint_and_resumes_with_a_fresh_budget(
    tmp_path: Path,
) -> None:
    config = time_budget_config(tmp_path)
    out = tmp_path / "out"
    argv = ("fit", "--config", str(config), "--output-dir", str(out), "--max-time", "1s")
    first = run_cli(*argv, cwd=tmp_path)
    assert first.returncode == 75, first.stderr
    assert "stopped early: time budget 1s spent" in first.stdout
    steps = int(first.stdout.split("steps=")[1].split()[0])
    assert saved_steps(out / "checkpoints") == [steps]
    pointer = json.loads((out / "checkpoints" / "latest.json").read_text())
    assert pointer["step"] == steps
    # requeued: the new job resumes and has a budget of its own again
    second = run_cli(*argv, "--resume", cwd=tmp_path)
    assert second.returncode == 75, second.stderr
    assert f"(step {steps})" in second.stdout
    later = int(second.stdout.split("steps=")[1].split()[0])
    assert later > steps and saved_steps(out / "checkpoints")[-1] == later


# -- saves by wall clock --------------------------------------------------------------------


def test_every_minutes_saves_at_the_first_step_past_the_interval(tmp_path: Path) -> None:
    slow = SlowSteps(0.03)
    interval_s = 0.15
    checkpoint = CheckpointCallback(
        tmp_path / "ck", every_steps=10**6, keep_last=None, every_minutes=interval_s / 60
    )
    saves: list[tuple[int, float, float]] = []  # (step, start, end) of every save
    save = checkpoint.manager.save

    def timed_save(step: int, state: Mapping[str, object], **kwargs: float | None) -> Path:
        start = time.monotonic()
        path = save(step, state, **kwargs)
        saves.append((step, start, time.monotonic()))
        return path

    checkpoint.manager.save = timed_save  # type: ignore[method-assign]  # observe the saves
    trainer = tiny_trainer([slow, checkpoint], k=1)
    trainer.fit(30)
    assert saved_steps(tmp_path / "ck") == [step for step, _, _ in saves]
    assert len(saves) >= 3 and saves[0][0] > 1 and saves[-1][0] == 30  # by time, then final
    for (_, _, end), (step, start, _) in zip(saves, saves[1:-1], strict=False):
        # the interval counts from the end of the previous save, and the save comes at the
        # first step that ends past it (a step is ~30 ms: allow it and some scheduling)
        assert interval_s <= start - end < interval_s + 0.03 + 0.25, saves
        assert step > 1


def test_every_minutes_must_be_positive() -> None:
    with pytest.raises(ConfigError, match=r"checkpoint.every_minutes"):
        SpeedtronicConfig.from_dict({"checkpoint": {"every_minutes": 0}})
    with pytest.raises(ValueError, match="every_minutes must be positive"):
        CheckpointCallback("ck", every_minutes=-1.0)


def test_a_deadline_in_one_process_reads_the_clock_and_needs_no_collective() -> None:
    deadline = Deadline(None)
    assert not deadline.multi_rank
    deadline.start_at(time.monotonic() + 60, step=0)
    assert not deadline.passed(1)
    deadline.start_at(time.monotonic() - 1, step=1)
    assert deadline.passed(2) and deadline.decisions == 0


def test_ranks_agree_on_the_budget_stop_and_timed_saves_with_few_collectives(
    tmp_path: Path, forked: Forked
) -> None:
    """Two gloo ranks whose steps take 20 ms or more: a 3 s budget and saves every second.
    Both ranks stop at the same step for the same reason, every timed save happened on both
    (the barrier after it would hang otherwise), and rank 0's clock was consulted -- one
    broadcast each -- at a few planned steps, not at every one: the budget at about
    log2(steps) of them, the saves at 1 + log2(steps per interval) per save."""
    reports = succeeded(launch(forked, "wall_clock", tmp_path, timeout=120))
    first, second = reports
    assert first["steps"] == second["steps"] and first["stop_reason"] == second["stop_reason"]
    assert first["stop_reason"] == "time budget 3s spent"
    steps = first["steps"]
    assert isinstance(steps, int) and steps > 10
    saved = first["saved"]
    assert isinstance(saved, list) and len(saved) >= 2 and saved[-1] == steps
    assert first["budget_decisions"] == second["budget_decisions"]
    assert first["save_decisions"] == second["save_decisions"]
    budget_decisions, save_decisions = first["budget_decisions"], first["save_decisions"]
    assert isinstance(budget_decisions, int) and 0 < budget_decisions <= 2 * math.log2(steps) + 2
    assert isinstance(save_decisions, int) and 0 < save_decisions <= 0.6 * steps, first
