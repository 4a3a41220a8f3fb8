"""Typed, immutable arguments for each event's hook.

Every hook receives ``(trainer, ctx)``; ``ctx`` is one of the named tuples below. They are
immutable so a callback cannot change what the next callback sees; things a callback may act
on (stop the run, ask for an optimizer reset, add a metric) go through the trainer's
methods or the metric record, which are documented for that purpose.

Why named tuples and not frozen dataclasses: the loop builds one context per listened event
per step, and a frozen dataclass's ``__init__`` (one ``object.__setattr__`` per field) costs
several times what a named tuple's construction does -- with 20 per-step callbacks that was
most of the framework's own per-step cost. Fields, defaults, ``repr`` and typing are the same.

The loop builds its per-step contexts with ``new_context`` (``tuple.__new__``, typed per
context below) rather than by calling the class: a named tuple's generated ``__new__`` is a
Python function behind ``type.__call__``, and skipping both halves a context's cost (about
2,600 -> 1,400 machine instructions per context: ``benchmarks/loop_pieces.py``). The result is
the same object: ``StepContext(3, 1) == new_context(StepContext, (3, 1))``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple, Protocol, TypeVar, overload

import torch

from speedtronic.engine.metrics import MetricRecord
from speedtronic.engine.result import TrainResult


class FitContext(NamedTuple):
    """``setup`` and ``fit_start``: the step the fit starts from and the absolute target."""

    start_step: int
    target_step: int


class StepContext(NamedTuple):
    """``step_start`` and ``step_end``. ``step`` is the 1-based number of this global step."""

    step: int
    accumulation_steps: int


class MicrobatchContext(NamedTuple):
    """``microbatch_start`` and ``microbatch_end``; ``index`` runs 0..K-1."""

    step: int
    index: int  # type: ignore[assignment]  # a field named index shadows tuple.index: intended
    accumulation_steps: int
    batch: object


class BackwardContext(NamedTuple):
    """``before_backward`` and ``after_backward``.

    ``loss`` is this microbatch's unscaled loss (a 0-d tensor still on the device; reading
    it with ``.item()`` forces a device sync, so do that only when you need the number).
    """

    step: int
    index: int  # type: ignore[assignment]  # a field named index shadows tuple.index: intended
    accumulation_steps: int
    loss: torch.Tensor


class OptimizerStepContext(NamedTuple):
    """``before_optimizer_step`` / ``after_optimizer_step``.

    Before the step the gradients are complete and unscaled. ``skipped`` is true after a step
    that the fp16 grad scaler skipped because of an overflow (the step is not counted).
    ``grad_norm`` is the total gradient norm when clipping computed it (a device tensor).
    ``loss`` is the step's loss (a device tensor: with one microbatch the model's own loss,
    else the mean over the step's loss-bearing tokens), as the loop has it -- read it (a
    guard on spikes does), never backward through it.
    """

    step: int
    skipped: bool = False
    grad_norm: torch.Tensor | None = None
    loss: torch.Tensor | None = None


class SchedulerContext(NamedTuple):
    """``after_scheduler_step``: the learning rate of each param group for the next step."""

    step: int
    lrs: tuple[float, ...]


class CoordinateContext(NamedTuple):
    """``coordinate``: sync callbacks act here; ``trainer.request_optimizer_reset`` asks for
    an ``optimizer_reset`` event later in the same step."""

    step: int


class OptimizerResetContext(NamedTuple):
    """``optimizer_reset``: who asked for it. The trainer clears the optimizer state after
    this event's callbacks ran."""

    step: int
    requested_by: tuple[str, ...]


_NO_METRICS: Mapping[str, float] = MappingProxyType({})
"""An empty, read-only metrics mapping (shared: it cannot be changed)."""


class EvalStartContext(NamedTuple):
    """``eval_start``: an evaluation of the held-out set begins at global step ``step``
    (after the step's optimizer update); ``max_batches`` is its batch limit (``None``: the
    whole held-out set)."""

    step: int
    max_batches: int | None


class EvalEndContext(NamedTuple):
    """``eval_end``: the evaluation of step ``step`` finished. ``metrics`` holds its results
    as host numbers (``eval/loss``, ``eval/ppl``; reduced over ranks in a distributed run);
    they join this step's metric record. ``batches`` and ``weight`` say how many batches were
    evaluated and how many tokens (causal-LM batches) or samples the loss is averaged over
    (this rank's share)."""

    step: int
    metrics: Mapping[str, float] = _NO_METRICS
    batches: int = 0
    weight: float = 0.0


class MetricsContext(NamedTuple):
    """``metrics``: the step's record. ``due`` is true on logging-cadence steps, on
    evaluation steps and on the final step of a fit; contributors add keys to ``record``,
    sinks read it when due. ``evaluated`` is true when the step ran an evaluation: the
    record then holds its ``eval/*`` keys."""

    step: int
    due: bool
    record: MetricRecord
    evaluated: bool = False


class CheckpointContext(NamedTuple):
    """``checkpoint``: the checkpoint callback saves here when its interval is due."""

    step: int


class FitEndContext(NamedTuple):
    """``fit_end``: the fit completed (target reached or a callback stopped it)."""

    result: TrainResult
    stop_reason: str | None


class ExceptionContext(NamedTuple):
    """``exception``: the error that is ending the fit, and the last completed step."""

    error: BaseException
    step: int


class TeardownContext(NamedTuple):
    """``teardown``: always runs last; ``error`` is set when the fit is failing."""

    step: int
    error: BaseException | None


_ContextT = TypeVar("_ContextT", bound=tuple[object, ...])


class NewContext(Protocol):
    """``tuple.__new__`` as the loop calls it: ``new_context(StepContext, (step, k))`` builds
    the named tuple from its fields in one C call. One overload per per-step context, so mypy
    checks the fields against the context's own (``tests/test_event_table.py`` checks that each
    overload's field types are the named tuple's, in order)."""

    @overload
    def __call__(self, cls: type[StepContext], fields: tuple[int, int], /) -> StepContext: ...
    @overload
    def __call__(
        self, cls: type[MicrobatchContext], fields: tuple[int, int, int, object], /
    ) -> MicrobatchContext: ...
    @overload
    def __call__(
        self, cls: type[BackwardContext], fields: tuple[int, int, int, torch.Tensor], /
    ) -> BackwardContext: ...
    @overload
    def __call__(
        self,
        cls: type[OptimizerStepContext],
        fields: tuple[int, bool, torch.Tensor | None, torch.Tensor | None],
        /,
    ) -> OptimizerStepContext: ...
    @overload
    def __call__(
        self, cls: type[SchedulerContext], fields: tuple[int, tuple[float, ...]], /
    ) -> SchedulerContext: ...
    @overload
    def __call__(
        self, cls: type[CoordinateContext], fields: tuple[int], /
    ) -> CoordinateContext: ...
    @overload
    def __call__(
        self, cls: type[CheckpointContext], fields: tuple[int], /
    ) -> CheckpointContext: ...
    @overload
    def __call__(
        self, cls: type[MetricsContext], fields: tuple[int, bool, MetricRecord, bool], /
    ) -> MetricsContext: ...
    def __call__(self, cls: type[_ContextT], fields: tuple[object, ...], /) -> _ContextT: ...


new_context: NewContext = tuple.__new__
"""Build a per-step context from its fields without the named tuple's Python ``__new__``."""
