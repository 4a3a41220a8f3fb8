"""Startup shape validation (warn-only) and the stage-stream scheduler's CPU no-op."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from speedtronic.systems.precision import resolve_precision
from speedtronic.systems.shapes import ShapeReport, resolve_shape_profile, validate_startup_shapes
from speedtronic.systems.stage_streams import StageStreamScheduler

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # a device object only: nothing runs on it here


@dataclass(frozen=True)
class Validation:
    enabled: bool = True
    alignment: int | str | None = "auto"
    check_batch: bool = True
    check_sequence: bool = True
    check_model: bool = True
    check_vocab: bool = False
    warn_on_cpu: bool = False


@dataclass(frozen=True)
class Data:
    micro_batch_size: int = 1
    target_batch_size: int = 8
    block_size: int | None = 5

    @property
    def micro_batch(self) -> int:
        return self.micro_batch_size


@dataclass(frozen=True)
class Model:
    vocab_size: int = 50


@dataclass(frozen=True)
class Config:
    shape_validation: Validation = field(default_factory=Validation)
    data: Data = field(default_factory=Data)
    model: Model = field(default_factory=Model)


class Recorder:
    def __init__(self) -> None:
        self.messages: list[str] = []

    def warning(self, msg: str, /) -> None:
        self.messages.append(msg)


def small_model(d_model: int = 12) -> nn.Module:
    return nn.Sequential(nn.Embedding(50, d_model), nn.Linear(d_model, d_model), nn.ReLU())


# -- profiles ---------------------------------------------------------------------------------


def test_profile_resolution() -> None:
    assert resolve_shape_profile(CUDA, "bf16").alignment == 8
    assert resolve_shape_profile(CUDA, "fp16", None).source == "cuda-mixed-precision"
    assert resolve_shape_profile(CUDA, "fp32").alignment is None
    assert resolve_shape_profile(CPU, "bf16").alignment is None
    assert resolve_shape_profile(CPU, "fp32", 16).source == "explicit"
    # "none" really disables (the original treated it like "auto").
    none = resolve_shape_profile(CUDA, "bf16", "none")
    assert none.alignment is None and none.source == "disabled"
    for bad in (0, -8, True, "sometimes"):
        with pytest.raises(ValueError, match="alignment"):
            resolve_shape_profile(CPU, "fp32", bad)


# -- validation ---------------------------------------------------------------------------------


def test_cpu_auto_profile_is_quiet_but_explicit_alignment_warns() -> None:
    plan = resolve_precision(None, CPU)
    quiet = validate_startup_shapes(Config(), small_model(), CPU, plan)
    assert quiet.profile.alignment is None and quiet.warnings == ()

    loud = Config(shape_validation=Validation(alignment=8, warn_on_cpu=True))
    recorder = Recorder()
    report = validate_startup_shapes(loud, small_model(), CPU, "bf16", recorder)
    codes = {w.code for w in report.warnings}
    assert {"batch_alignment", "model_alignment", "sequence_alignment"} <= codes
    assert all(w.suggested is not None for w in report.warnings)
    batch = next(w for w in report.warnings if w.code == "batch_alignment")
    assert (batch.value, batch.suggested) == (1, 8)
    assert len(recorder.messages) == len(report.warnings)
    assert recorder.messages[0].startswith("shape warning: ")


def test_explicit_cpu_profile_requires_opt_in_and_avoids_invalid_batch_suggestion() -> None:
    data = Data(micro_batch_size=3, target_batch_size=9)
    opted_in = Config(Validation(alignment=8, warn_on_cpu=True, check_model=False), data)
    report = validate_startup_shapes(opted_in, small_model(), CPU, "fp32", Recorder())
    batch = next(w for w in report.warnings if w.code == "batch_alignment")
    assert batch.suggested is None  # no multiple of 8 divides 9
    assert "no aligned fit" in batch.message()
    silent = Config(Validation(alignment=8), data)
    assert validate_startup_shapes(silent, small_model(), CPU, "fp32").warnings == ()


def test_batch_suggestion_divides_the_target_batch() -> None:
    config = Config(Validation(alignment=8, warn_on_cpu=True), Data(12, 24, 16))
    report = validate_startup_shapes(config, small_model(16), CPU, "fp32", Recorder())
    batch = next(w for w in report.warnings if w.code == "batch_alignment")
    assert batch.suggested == 24  # 16 would not divide 24


def test_shape_report_is_non_fatal_and_deduplicated() -> None:
    config = Config(Validation(alignment=8, warn_on_cpu=True))
    model = nn.Sequential(nn.Linear(12, 12), nn.Linear(12, 12))
    first = validate_startup_shapes(config, model, CPU, "fp32", Recorder())
    second = validate_startup_shapes(config, model, CPU, "fp32", Recorder())
    assert isinstance(first, ShapeReport) and first == second
    keys = [(w.field, w.value, w.alignment) for w in first.warnings]
    assert len(keys) == len(set(keys))
    assert first.as_dict()["warning_count"] == len(first.warnings)


def test_model_metadata_hook_vocab_check_and_disabled_section() -> None:
    class Declared(nn.Module):
        vocab_size = 50

        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(12, 12)  # ignored: the hook wins

        def speedtronic_shape_metadata(self) -> dict[str, int]:
            return {"d_model": 64, "head_dim": 20}

    config = Config(Validation(alignment=8, warn_on_cpu=True, check_vocab=True), Data(8, 8, 16))
    report = validate_startup_shapes(config, Declared(), CPU, "fp32", Recorder())
    fields = {w.field: w.suggested for w in report.warnings}
    assert fields == {"model.head_dim": 24, "model.vocab_size": 56}

    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(12, 16)

        def speedtronic_shape_metadata(self) -> dict[str, int]:
            raise RuntimeError("no metadata today")

    report = validate_startup_shapes(config, Broken(), CPU, "fp32", Recorder())
    assert {w.field for w in report.warnings} >= {"linear.in_features"}

    disabled = Config(Validation(enabled=False, alignment=8, warn_on_cpu=True))
    assert validate_startup_shapes(disabled, Broken(), CPU, "fp32").warnings == ()


def test_shape_validation_accepts_standard_library_logger(caplog: pytest.LogCaptureFixture) -> None:
    config = Config(Validation(alignment=8, warn_on_cpu=True))
    logger = logging.getLogger("test.shapes")
    with caplog.at_level(logging.WARNING, logger="test.shapes"):
        report = validate_startup_shapes(config, small_model(), CPU, "fp32", logger)
    assert len(caplog.records) == len(report.warnings) > 0


# -- stage streams ------------------------------------------------------------------------------


def test_out_of_order_scheduler_degrades_to_noop_on_cpu() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    scheduler = StageStreamScheduler(model, CPU, num_streams=2)
    assert scheduler.enabled is False
    assert "cpu" in scheduler.reason
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    scheduler.begin()
    output = model(torch.ones(1, 4))
    scheduler.finish()
    assert output.shape == (1, 2)
    scheduler.remove_hooks()
    scheduler.dispose()
    scheduler.dispose()
    assert scheduler.as_dict() == {
        "enabled": False,
        "reason": scheduler.reason,
        "streams": 0,
        "stages": [],
    }


def test_out_of_order_scheduler_names_mps_and_clamps_streams() -> None:
    scheduler = StageStreamScheduler(nn.Linear(2, 2), "mps", num_streams=99)
    assert not scheduler.enabled and "mps" in scheduler.reason
    assert scheduler.requested_streams == 8
