"""The original (2.0) API, issue 15 items 1, 2 and 5: the top-level names, the builders that
take the whole config, ``runtime.build_logger`` / ``trainer.logger``, and the 2.0 events
reaching ``MetricLogger`` hooks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import speedtronic
from speedtronic.compat.exports import kept_names
from speedtronic.config import ConfigError, SpeedtronicConfig

V2_TOP_LEVEL_NAMES = (
    # config classes
    "RunConfig",
    "ModelConfig",
    "DataConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "PrecisionConfig",
    "CheckpointConfig",
    "LoggingConfig",
    "DistributedConfig",
    "ShapeValidationConfig",
    # v2 optimizers
    "CautiousOptimizer",
    "HybridOptimizer",
    "Muon",
    "ParameterRouting",
    "newton_schulz",
    "post_polar_normalize",
    "route_parameters",
    # out-of-order backprop
    "StageInfo",
    "StageStreamScheduler",
    # shape validation
    "ShapeProfile",
    "ShapeReport",
    "ShapeWarning",
    "resolve_shape_profile",
    "validate_startup_shapes",
    # DiLoCo
    "DumbDiLoCoCoordinator",
)
"""The 25 names 2.0's ``speedtronic/__init__.py`` exported that 3.0 had dropped."""


def tiny(tmp_path: Path, **extra: object) -> dict[str, object]:
    config: dict[str, object] = {
        "run": {"device": "cpu", "max_steps": 2, "output_dir": str(tmp_path / "run")},
        "model": {"vocab_size": 32, "max_seq_len": 8, "n_layer": 1, "n_head": 4, "d_model": 32},
        "data": {"num_tokens": 32, "micro_batch_size": 2},
        "scheduler": {"warmup_steps": 0},
        "logging": {"console": False},
    }
    config.update(extra)
    return config


# -- item 1: top-level names --------------------------------------------------------------


def test_every_2_0_top_level_name_imports_from_speedtronic() -> None:
    assert len(V2_TOP_LEVEL_NAMES) == 25
    for name in V2_TOP_LEVEL_NAMES:
        assert name in speedtronic.__all__ or name in kept_names(), name
        assert getattr(speedtronic, name) is not None, name
    from speedtronic.config import RunConfig
    from speedtronic.optimizers import Muon
    from speedtronic.systems.stage_streams import StageStreamScheduler

    assert speedtronic.RunConfig is RunConfig
    assert speedtronic.Muon is Muon
    assert speedtronic.StageStreamScheduler is StageStreamScheduler


def test_checkpoint_config_keeps_the_2_0_fields_and_checks() -> None:
    section = speedtronic.CheckpointConfig(every_steps=50, keep_last=None)
    assert section.to_dict() == {
        "enabled": True,
        "directory": "checkpoints",
        "every_steps": 50,
        "keep_last": None,
        "resume": False,
    }
    config = SpeedtronicConfig.from_dict({"checkpoint": section.to_dict()})
    assert config.checkpoint.every_steps == 50
    with pytest.raises(ConfigError, match="every_steps must be positive"):
        speedtronic.CheckpointConfig(every_steps=0)
    with pytest.raises(ConfigError, match="keep_last must be positive or null"):
        speedtronic.CheckpointConfig(keep_last=0)


# -- item 2: builders ---------------------------------------------------------------------


def test_build_optimizer_and_scheduler_take_the_whole_config_or_the_section() -> None:
    from speedtronic.optimizers import HybridOptimizer, build_v2_optimizer
    from speedtronic.runtime import build_optimizer, build_scheduler

    config = SpeedtronicConfig.from_dict(
        {
            "run": {"max_steps": 40},
            "optimizer": {"name": "muon", "lr": 0.01},
            "scheduler": {"warmup_steps": 4},
        }
    )
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    whole = build_optimizer(model, config)  # 2.0: the whole config, device from the model
    section = build_optimizer(model, config.optimizer, torch.device("cpu"))
    assert isinstance(whole, HybridOptimizer) and isinstance(section, HybridOptimizer)
    assert isinstance(build_v2_optimizer(model, config, "cpu"), HybridOptimizer)

    from_config = build_scheduler(whole, config)  # horizon: the run's 40 steps
    from_section = build_scheduler(section, config.scheduler, 40)
    for _ in range(30):
        whole.step()
        section.step()
        from_config.step()
        from_section.step()
    assert from_config.get_last_lr() == pytest.approx(from_section.get_last_lr())
    assert from_config.get_last_lr()[0] < 0.01  # cosine over 40 steps, not the 2.0 default 1000


def test_build_scheduler_from_a_section_needs_a_horizon() -> None:
    from speedtronic.runtime import build_scheduler

    config = SpeedtronicConfig.from_dict({"scheduler": {"max_steps": 10, "warmup_steps": 0}})
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    build_scheduler(optimizer, config.scheduler)  # the section's own max_steps
    with pytest.raises(ValueError, match="needs max_steps"):
        build_scheduler(optimizer, SpeedtronicConfig.from_dict({}).scheduler)


def test_build_logger_maps_the_logging_section(tmp_path: Path) -> None:
    from speedtronic.runtime import build_logger

    text, lines = tmp_path / "log.txt", tmp_path / "events.jsonl"
    section = {"level": "debug", "file": str(text), "json_file": str(lines), "every_steps": 3}
    logger = build_logger({"logging": section})
    assert (logger.level, logger.every_steps, logger.hooks) == ("DEBUG", 3, [])
    logger.emit("train_step", {"step": 3, "loss": 1.5})
    logger.emit("train_step", {"step": 4, "loss": 1.4})  # not due
    logger.close()
    assert "train_step step=3 loss=1.5" in text.read_text()
    records = [json.loads(line) for line in lines.read_text().splitlines()]
    assert [(r["event"], r["step"]) for r in records] == [("train_step", 3)]


def test_runtime_built_trainer_exposes_a_logger_for_2_0_hooks(tmp_path: Path) -> None:
    from speedtronic import build_runtime

    trainer, _ = build_runtime(tiny(tmp_path))
    assert trainer.logger is not None
    seen: list[tuple[str, dict[str, object]]] = []
    trainer.logger.hooks.append(lambda event, payload: seen.append((event, payload)))
    trainer.fit()
    names = [event for event, _ in seen]
    assert names[0] == "train_start" and names.count("train_step") == 2
    assert "train_end" in names and "checkpoint" in names
    first_step = next(payload for event, payload in seen if event == "train_step")
    assert first_step["step"] == 1 and isinstance(first_step["loss"], float)
    # the hooks-only logger prints nothing and writes no file of its own
    assert trainer.logger.file is None and trainer.logger.json_file is None


def test_a_run_that_never_reads_trainer_logger_runs_no_2_0_callback(tmp_path: Path) -> None:
    from speedtronic import Trainer, build_runtime
    from speedtronic.compat.metric_logger import MetricLoggerCallback
    from speedtronic.engine.events import Event

    def adapters(trainer: Trainer) -> list[MetricLoggerCallback]:
        return [cb for cb in trainer.callbacks if isinstance(cb, MetricLoggerCallback)]

    def from_2_0_layer(trainer: Trainer) -> list[str]:
        """The trainer's callbacks whose code is the 2.0 layer's (``speedtronic.compat``)."""
        return [
            type(cb).__qualname__
            for cb in trainer.callbacks
            if type(cb).__module__.startswith("speedtronic.compat")
        ]

    trainer, _ = build_runtime(tiny(tmp_path))
    trainer.fit()
    assert adapters(trainer) == [] and from_2_0_layer(trainer) == []
    # config= (2.0) is resolved into settings when the trainer is built: nothing per step.
    model = nn.Linear(2, 1)
    configured = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        [(torch.ones(1, 2),)],
        config=SpeedtronicConfig.from_dict(tiny(tmp_path, logging={"every_steps": 3})),
    )
    assert configured.metrics_every == 3 and from_2_0_layer(configured) == []
    assert "metric_logger" not in dict(trainer.plan.describe())[Event.STEP_END]
    logger = trainer.logger  # the first read builds it and attaches its callback
    assert logger is not None and trainer.logger is logger
    assert [cb.logger for cb in adapters(trainer)] == [logger]
    assert "metric_logger" in dict(trainer.plan.describe())[Event.STEP_END]
    # A trainer built in Python without logger= has none, as before.
    model = nn.Linear(2, 1)
    plain = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), [(torch.ones(1, 2),)])
    assert plain.logger is None and adapters(plain) == []


def test_a_logger_first_read_during_a_fit_hears_the_rest_of_it(tmp_path: Path) -> None:
    from speedtronic import Callback, build_runtime
    from speedtronic.engine.contexts import StepContext
    from speedtronic.engine.view import TrainerView

    seen: list[tuple[str, object]] = []

    class ReadsTheLogger(Callback):
        def on_step_end(self, trainer: TrainerView, ctx: StepContext) -> None:
            if ctx.step == 1:
                logger = built.logger
                assert logger is not None
                logger.hooks.append(lambda event, data: seen.append((event, data.get("step"))))

    config = tiny(tmp_path)
    config["run"] = {**config["run"], "max_steps": 3}  # type: ignore[dict-item]
    built, _ = build_runtime(config, extra_callbacks=[ReadsTheLogger()])
    built.fit()
    steps = [step for event, step in seen if event == "train_step"]
    assert steps == [2, 3]
    # the final checkpoint (saved at fit_end) is reported after train_end, as always
    assert [event for event, _ in seen][-2:] == ["train_end", "checkpoint"]
    assert seen[-1] == ("checkpoint", 3)


# -- item 5: the 2.0 events reach MetricLogger hooks ----------------------------------------


def _recorded(trainer: speedtronic.Trainer) -> list[tuple[str, dict[str, object]]]:
    seen: list[tuple[str, dict[str, object]]] = []
    assert trainer.logger is not None
    trainer.logger.hooks.append(lambda event, payload: seen.append((event, payload)))
    return seen


def test_compile_ooo_backprop_and_shape_events_reach_hooks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from speedtronic import build_runtime

    def no_compiler(module: object) -> object:
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", no_compiler)
    config = tiny(
        tmp_path,
        compile=True,
        ooo_backprop=True,
        ooo_streams=2,
        shape_validation={"alignment": 8, "warn_on_cpu": True},
    )
    config["data"] = {"num_tokens": 32, "micro_batch_size": 3, "target_batch_size": 3}
    trainer, _ = build_runtime(config)
    seen = _recorded(trainer)
    with pytest.warns(RuntimeWarning, match="torch.compile unavailable"):
        trainer.fit()
    events = dict(seen)  # the last payload of each name
    assert events["compile"] == {
        "enabled": False,
        "reason": "torch.compile unavailable (no compiler here)",
        "elapsed_s": events["compile"]["elapsed_s"],
    }
    assert events["ooo_backprop"]["enabled"] is False
    assert "cpu" in str(events["ooo_backprop"]["reason"])
    profile = events["shape_profile"]
    assert profile["alignment"] == 8 and profile["device_type"] == "cpu"
    warnings = [payload for event, payload in seen if event == "shape_warning"]
    assert len(warnings) == profile["warning_count"] >= 1
    assert {"field", "value", "suggested", "alignment"} <= set(warnings[0])
    names = [event for event, _ in seen]
    assert names.index("compile") < names.index("train_step")
    assert names.index("shape_profile") < names.index("train_step")
    with pytest.warns(RuntimeWarning, match="torch.compile unavailable"):
        trainer.fit(max_steps=3)  # the startup report is not repeated by a later fit
    assert [event for event, _ in seen].count("shape_profile") == 1


def test_a_failing_note_listener_does_not_break_the_publisher(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from speedtronic.engine.notes import Notes

    notes = Notes()
    notes.publish("nobody", {"x": 1})  # no listener: nothing happens
    got: list[tuple[str, dict[str, object]]] = []

    def broken(event: str, payload: dict[str, object]) -> None:
        raise ValueError("broken listener")

    notes.subscribe(broken)
    stop = notes.subscribe(lambda event, payload: got.append((event, payload)))
    notes.publish("outer_step", {"outer_step": 1})
    notes.publish("outer_step", {"outer_step": 2})
    stop()
    notes.publish("outer_step", {"outer_step": 3})
    assert got == [("outer_step", {"outer_step": 1}), ("outer_step", {"outer_step": 2})]
    assert caplog.text.count("broken listener") == 1  # logged once per listener and event


def test_json_file_lines_carry_the_event_key_as_in_2_0(tmp_path: Path) -> None:
    from speedtronic import train_from_config

    train_from_config(tiny(tmp_path, logging={"console": False, "json_file": "events.jsonl"}))
    lines = (tmp_path / "run" / "events.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [(r["event"], r["step"]) for r in records] == [("train_step", 1), ("train_step", 2)]
    assert list(records[0])[0] == "event"
    # the default metrics.jsonl (no 2.0 json_file) keeps its own format
    train_from_config(tiny(tmp_path / "b"))
    plain = json.loads((tmp_path / "b" / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert "event" not in plain
