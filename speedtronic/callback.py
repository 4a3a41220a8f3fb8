"""The ``Callback`` base class: one typed, no-op method per event.

Subclass it and override the hooks you need. The trainer only calls hooks a subclass
overrides, so an unused hook costs nothing. Hooks receive the trainer and a frozen,
typed context (``speedtronic.contexts``); mypy --strict checks your overrides against
these signatures.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar, Literal, cast

from typing_extensions import Self

from speedtronic.contexts import (
    BackwardContext,
    CheckpointContext,
    CoordinateContext,
    ExceptionContext,
    FitContext,
    FitEndContext,
    MetricsContext,
    MicrobatchContext,
    OptimizerResetContext,
    OptimizerStepContext,
    SchedulerContext,
    StepContext,
    TeardownContext,
)
from speedtronic.events import Event
from speedtronic.filters import StepFilter

if TYPE_CHECKING:
    from speedtronic.plugins import PluginContext
    from speedtronic.view import TrainerView

JSONSchema = Mapping[str, object]
"""A JSON Schema document (draft 2020-12) as a mapping."""

EMPTY_OPTIONS_SCHEMA: JSONSchema = {"type": "object", "additionalProperties": False}

RankPolicy = Literal["all", "main", "local_main"]
"""Which ranks of a distributed run call a callback's hooks (``Callback.rank_policy``)."""


class Callback:
    """Base class for everything that plugs into the training loop.

    Class attributes a plugin may set:

    * ``state_key`` -- a unique name when the callback has state to checkpoint;
      ``state_dict()`` is saved under it and ``load_state_dict()`` restores it on resume.
    * ``is_observer`` -- ``True`` for callbacks that only watch (sinks, loggers): an
      exception in one of their hooks is reported once as a warning and training goes on.
      Any other callback's exception stops the run.
    * ``metrics_phase`` -- at the ``metrics`` event all ``"contribute"`` callbacks run
      (in order) before all ``"consume"`` callbacks (sinks), so a sink sees every key.
    * ``plugin_name`` / ``options_schema`` -- the name used in ``callbacks:`` in config and
      the JSON Schema of its options (the ``name`` key excluded).
    * ``due_when`` -- per event, the steps on which the hook is due (``speedtronic.filters``:
      ``every(n)``, ``once(step)``, ``final_step()``, ``logging_steps()``); the trainer does
      not call the hook on other steps. Set it on the class or, for a cadence that comes from
      options, on the instance in ``__init__``. Hooks without an entry run on every step.
    * ``rank_policy`` -- where the callback runs in a distributed run: ``"all"`` ranks (the
      default; anything that takes part in collectives or changes training), rank 0 only
      (``"main"``: sinks and loggers) or once per node (``"local_main"``, local rank 0).
      A single-process run is rank 0 and runs every callback.
    """

    state_key: str | None = None
    is_observer: ClassVar[bool] = False
    metrics_phase: ClassVar[Literal["contribute", "consume"]] = "contribute"
    plugin_name: ClassVar[str | None] = None
    options_schema: ClassVar[JSONSchema] = EMPTY_OPTIONS_SCHEMA
    rank_policy: ClassVar[RankPolicy] = "all"
    due_when: Mapping[Event, StepFilter] = MappingProxyType({})

    # -- construction from config -----------------------------------------------------

    @classmethod
    def from_options(cls, options: Mapping[str, object], context: PluginContext) -> Self:
        """Build from validated ``callbacks:`` options. The default passes them as keyword
        arguments; override to use the run's context (output directory, config, device)."""
        del context
        factory = cast("type[object]", cls)
        return cast(Self, factory(**options))

    # -- state --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, object]:
        """State saved in every checkpoint under ``state_key`` (tensors, numbers, strings,
        lists and dicts of those only: checkpoints load without pickle)."""
        return {}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore what ``state_dict`` returned."""
        del state

    # -- fit-level events ---------------------------------------------------------------

    def on_setup(self, trainer: TrainerView, ctx: FitContext) -> None:
        """Before anything runs: the model is on its device, counters are final."""

    def on_fit_start(self, trainer: TrainerView, ctx: FitContext) -> None:
        """Right before the first global step of this fit."""

    def on_fit_end(self, trainer: TrainerView, ctx: FitEndContext) -> None:
        """After the last step of a successful fit (target reached or stopped cleanly)."""

    def on_exception(self, trainer: TrainerView, ctx: ExceptionContext) -> None:
        """The fit is failing with ``ctx.error``; ``teardown`` follows."""

    def on_teardown(self, trainer: TrainerView, ctx: TeardownContext) -> None:
        """Always runs last, after success or failure: close files, stop threads."""

    # -- per global step ----------------------------------------------------------------

    def on_step_start(self, trainer: TrainerView, ctx: StepContext) -> None:
        """A global step begins."""

    def on_microbatch_start(self, trainer: TrainerView, ctx: MicrobatchContext) -> None:
        """A microbatch is on the device; the forward pass is next."""

    def on_before_backward(self, trainer: TrainerView, ctx: BackwardContext) -> None:
        """The forward pass produced ``ctx.loss``; backward of ``loss / K`` is next."""

    def on_after_backward(self, trainer: TrainerView, ctx: BackwardContext) -> None:
        """This microbatch's gradients have been accumulated."""

    def on_microbatch_end(self, trainer: TrainerView, ctx: MicrobatchContext) -> None:
        """The microbatch is done."""

    def on_before_optimizer_step(self, trainer: TrainerView, ctx: OptimizerStepContext) -> None:
        """Gradients are complete and unscaled (clipping, norms, NaN checks live here)."""

    def on_after_optimizer_step(self, trainer: TrainerView, ctx: OptimizerStepContext) -> None:
        """The optimizer stepped (or the grad scaler skipped the step: ``ctx.skipped``)."""

    def on_after_scheduler_step(self, trainer: TrainerView, ctx: SchedulerContext) -> None:
        """The learning-rate scheduler stepped."""

    def on_coordinate(self, trainer: TrainerView, ctx: CoordinateContext) -> None:
        """Synchronisation point (DiLoCo). Call ``trainer.request_optimizer_reset`` to ask
        for an ``optimizer_reset`` in this step."""

    def on_optimizer_reset(self, trainer: TrainerView, ctx: OptimizerResetContext) -> None:
        """The inner optimizer state is about to be cleared."""

    def on_metrics(self, trainer: TrainerView, ctx: MetricsContext) -> None:
        """Contribute keys to ``ctx.record`` or, as a sink, consume it when ``ctx.due``."""

    def on_checkpoint(self, trainer: TrainerView, ctx: CheckpointContext) -> None:
        """Checkpoint point of the step."""

    def on_step_end(self, trainer: TrainerView, ctx: StepContext) -> None:
        """The global step is complete."""

    # -- helpers ------------------------------------------------------------------------

    @property
    def display_name(self) -> str:
        """How this callback is named in plans, warnings and errors."""
        return self.plugin_name or type(self).__name__
