"""Typed, frozen arguments for each event's hook.

Every hook receives ``(trainer, ctx)``; ``ctx`` is one of the dataclasses below. They are
frozen so a callback cannot change what the next callback sees; things a callback may act
on (stop the run, ask for an optimizer reset, add a metric) go through the trainer's
methods or the metric record, which are documented for that purpose.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from speedtronic.metrics import MetricRecord
from speedtronic.result import TrainResult


@dataclass(frozen=True, slots=True)
class FitContext:
    """``setup`` and ``fit_start``: the step the fit starts from and the absolute target."""

    start_step: int
    target_step: int


@dataclass(frozen=True, slots=True)
class StepContext:
    """``step_start`` and ``step_end``. ``step`` is the 1-based number of this global step."""

    step: int
    accumulation_steps: int


@dataclass(frozen=True, slots=True)
class MicrobatchContext:
    """``microbatch_start`` and ``microbatch_end``; ``index`` runs 0..K-1."""

    step: int
    index: int
    accumulation_steps: int
    batch: object


@dataclass(frozen=True, slots=True)
class BackwardContext:
    """``before_backward`` and ``after_backward``.

    ``loss`` is this microbatch's unscaled loss (a 0-d tensor still on the device; reading
    it with ``.item()`` forces a device sync, so do that only when you need the number).
    """

    step: int
    index: int
    accumulation_steps: int
    loss: torch.Tensor


@dataclass(frozen=True, slots=True)
class OptimizerStepContext:
    """``before_optimizer_step`` / ``after_optimizer_step``.

    Before the step the gradients are complete and unscaled. ``skipped`` is true after a step
    that the fp16 grad scaler skipped because of an overflow (the step is not counted).
    ``grad_norm`` is the total gradient norm when clipping computed it (a device tensor).
    """

    step: int
    skipped: bool = False
    grad_norm: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class SchedulerContext:
    """``after_scheduler_step``: the learning rate of each param group for the next step."""

    step: int
    lrs: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class CoordinateContext:
    """``coordinate``: sync callbacks act here; ``trainer.request_optimizer_reset`` asks for
    an ``optimizer_reset`` event later in the same step."""

    step: int


@dataclass(frozen=True, slots=True)
class OptimizerResetContext:
    """``optimizer_reset``: who asked for it. The trainer clears the optimizer state after
    this event's callbacks ran."""

    step: int
    requested_by: tuple[str, ...]


def _no_metrics() -> Mapping[str, float]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class EvalStartContext:
    """``eval_start``: an evaluation of the held-out set begins at global step ``step``
    (after the step's optimizer update); ``max_batches`` is its batch limit (``None``: the
    whole held-out set)."""

    step: int
    max_batches: int | None


@dataclass(frozen=True, slots=True)
class EvalEndContext:
    """``eval_end``: the evaluation of step ``step`` finished. ``metrics`` holds its results
    as host numbers (``eval/loss``, ``eval/ppl``; reduced over ranks in a distributed run);
    they join this step's metric record. ``batches`` and ``weight`` say how many batches were
    evaluated and how many tokens (causal-LM batches) or samples the loss is averaged over
    (this rank's share)."""

    step: int
    metrics: Mapping[str, float] = field(default_factory=_no_metrics)
    batches: int = 0
    weight: float = 0.0


@dataclass(frozen=True, slots=True)
class MetricsContext:
    """``metrics``: the step's record. ``due`` is true on logging-cadence steps, on
    evaluation steps and on the final step of a fit; contributors add keys to ``record``,
    sinks read it when due. ``evaluated`` is true when the step ran an evaluation: the
    record then holds its ``eval/*`` keys."""

    step: int
    due: bool
    record: MetricRecord
    evaluated: bool = False


@dataclass(frozen=True, slots=True)
class CheckpointContext:
    """``checkpoint``: the checkpoint callback saves here when its interval is due."""

    step: int


@dataclass(frozen=True, slots=True)
class FitEndContext:
    """``fit_end``: the fit completed (target reached or a callback stopped it)."""

    result: TrainResult
    stop_reason: str | None


@dataclass(frozen=True, slots=True)
class ExceptionContext:
    """``exception``: the error that is ending the fit, and the last completed step."""

    error: BaseException
    step: int


@dataclass(frozen=True, slots=True)
class TeardownContext:
    """``teardown``: always runs last; ``error`` is set when the fit is failing."""

    step: int
    error: BaseException | None
