"""The ``Callback`` base class: one typed, no-op method per event.

Subclass it and override the hooks you need. The trainer only calls hooks a subclass
overrides, so an unused hook costs nothing. Hooks receive the trainer and a frozen,
typed context (``speedtronic.engine.contexts``); mypy --strict checks your overrides against
these signatures.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar, Literal

from speedtronic.engine.contexts import (
    BackwardContext,
    CheckpointContext,
    CoordinateContext,
    EvalEndContext,
    EvalStartContext,
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
from speedtronic.engine.events import Event
from speedtronic.engine.filters import StepFilter

# What a plugin declares is its ``PluginSpec`` (speedtronic.plugins); these names stay here
# for code that imports them from the hook API.
from speedtronic.plugins import EMPTY_OPTIONS_SCHEMA as EMPTY_OPTIONS_SCHEMA
from speedtronic.plugins import JSONSchema as JSONSchema
from speedtronic.plugins import PluginOptions as PluginOptions
from speedtronic.plugins import RankPolicy as RankPolicy
from speedtronic.plugins import SectionData as SectionData
from speedtronic.plugins import section_of as section_of

if TYPE_CHECKING:
    from speedtronic.engine.view import TrainerView

LegacySections = SectionData
"""Former name of ``speedtronic.plugins.SectionData``."""

legacy_section = section_of
"""Former name of ``speedtronic.plugins.section_of``."""


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
    * ``plugin_name`` -- the name the callback goes by in plans, warnings and errors (a
      plugin's ``callbacks:`` name; what the plugin declares beyond that -- options, the
      sections it reads, its place in a run -- is its ``PluginSpec``, see
      ``speedtronic.plugins``).
    * ``due_when`` -- per event, the steps on which the hook is due (``speedtronic.engine.filters``:
      ``every(n)``, ``once(step)``, ``final_step()``, ``logging_steps()``); the trainer does
      not call the hook on other steps. Set it on the class or, for a cadence that comes from
      options, on the instance in ``__init__``. Hooks without an entry run on every step.
    * ``rank_policy`` -- where the callback runs in a distributed run: ``"all"`` ranks (the
      default; anything that takes part in collectives or changes training), rank 0 only
      (``"main"``: sinks and loggers) or once per node (``"local_main"``, local rank 0).
      A single-process run is rank 0 and runs every callback.
    * ``optimizer_decay_norms_and_biases`` -- what the callback proposes for
      ``optimizer.decay_norms_and_biases`` when the config leaves it ``null`` (the first
      callback of a run with a proposal decides; ``None``: no proposal; an explicit config
      value always wins; see docs/optimizers.md).
    """

    if TYPE_CHECKING:
        # For mypy a settable property, so a subclass may declare it in any of the usual
        # ways -- ``state_key = "x"``, ``state_key: ClassVar[str] = "x"``,
        # ``state_key: str | None = "x"`` -- or set ``self.state_key`` in ``__init__``. (A
        # plain ``str | None`` attribute here would reject the ``ClassVar`` spelling, a
        # ``ClassVar`` the other two.) At run time it is the class attribute below.

        @property
        def state_key(self) -> str | None: ...

        @state_key.setter
        def state_key(self, value: str | None) -> None: ...

    else:
        state_key = None
    is_observer: ClassVar[bool] = False
    metrics_phase: ClassVar[Literal["contribute", "consume"]] = "contribute"
    plugin_name: ClassVar[str | None] = None
    rank_policy: ClassVar[RankPolicy] = "all"
    due_when: Mapping[Event, StepFilter] = MappingProxyType({})
    optimizer_decay_norms_and_biases: ClassVar[bool | None] = None

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

    def on_eval_start(self, trainer: TrainerView, ctx: EvalStartContext) -> None:
        """An evaluation of the held-out set begins (evaluation steps only)."""

    def on_eval_end(self, trainer: TrainerView, ctx: EvalEndContext) -> None:
        """An evaluation finished; ``ctx.metrics`` joins this step's metric record."""

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
