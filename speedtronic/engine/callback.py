"""The ``Callback`` base class: one typed, no-op method per event.

Subclass it and override the hooks you need. The trainer only calls hooks a subclass
overrides, so an unused hook costs nothing. Hooks receive the trainer and a frozen,
typed context (``speedtronic.engine.contexts``); mypy --strict checks your overrides against
these signatures.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar, Literal, cast

from typing_extensions import Self

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

if TYPE_CHECKING:
    from speedtronic.engine.view import TrainerView
    from speedtronic.plugins import PluginContext

JSONSchema = Mapping[str, object]
"""A JSON Schema document (draft 2020-12) as a mapping."""

EMPTY_OPTIONS_SCHEMA: JSONSchema = {"type": "object", "additionalProperties": False}

RankPolicy = Literal["all", "main", "local_main"]
"""Which ranks of a distributed run call a callback's hooks (``Callback.rank_policy``)."""

# == plugin configuration (types) =====================================================

LegacySections = Mapping[str, object]
"""The 2.0 top-level keys a plugin declared in ``legacy_sections``, as validated plain data
(``{"checkpoint": {"every_steps": 500, ...}}``); a key the config leaves out holds its
schema defaults."""

PluginOptions = dict[str, object]
"""Options of one ``callbacks:`` entry (``name`` excluded), as ``from_options`` gets them."""


def legacy_section(sections: LegacySections, key: str) -> Mapping[str, object]:
    """The mapping under ``key`` of ``sections`` (``{}`` when absent or not a mapping)."""
    value = sections.get(key)
    return cast("Mapping[str, object]", value) if isinstance(value, Mapping) else {}


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
    * ``due_when`` -- per event, the steps on which the hook is due (``speedtronic.engine.filters``:
      ``every(n)``, ``once(step)``, ``final_step()``, ``logging_steps()``); the trainer does
      not call the hook on other steps. Set it on the class or, for a cadence that comes from
      options, on the instance in ``__init__``. Hooks without an entry run on every step.
    * ``rank_policy`` -- where the callback runs in a distributed run: ``"all"`` ranks (the
      default; anything that takes part in collectives or changes training), rank 0 only
      (``"main"``: sinks and loggers) or once per node (``"local_main"``, local rank 0).
      A single-process run is rank 0 and runs every callback.
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
    options_schema: ClassVar[JSONSchema] = EMPTY_OPTIONS_SCHEMA
    rank_policy: ClassVar[RankPolicy] = "all"
    due_when: Mapping[Event, StepFilter] = MappingProxyType({})

    # == plugin configuration ===========================================================
    # Read by the composition root (``speedtronic.runtime``) and by config validation,
    # never by the training loop. See docs/callbacks.md, "Declaring configuration".

    enabled_by_default: ClassVar[bool] = False
    """Add this plugin to every run whose config does not name it (unless its 2.0 sections
    turn it off, see ``options_from_legacy``)."""

    default_replaced_by: ClassVar[tuple[str, ...]] = ()
    """Plugins that, when named in ``callbacks:``, stand in for this default one (the
    ``progress`` bar replaces the default ``console`` sink)."""

    implied_order: ClassVar[int] = 0
    """Where the plugin goes when the config turns it on without naming it: a negative
    value before the ``callbacks:`` list, otherwise after it; ascending, ties by name."""

    optimizer_decay_norms_and_biases: ClassVar[bool | None] = None
    """What the plugin proposes for ``optimizer.decay_norms_and_biases`` when the config
    leaves it ``null``: the first callback of a run with a proposal decides (``None``: no
    proposal). An explicit config value always wins. See docs/optimizers.md."""

    legacy_sections: ClassVar[tuple[str, ...]] = ()
    """The top-level keys of a 2.0 config this plugin reads (``("checkpoint",)``)."""

    legacy_schema: ClassVar[Mapping[str, JSONSchema]] = {}
    """JSON Schema of what the plugin adds to those keys, by key. An object schema whose
    key the core also declares (``logging``) contributes its ``properties`` to it; any
    other becomes the key's whole schema. Composed into the run schema generically."""

    legacy_aliases: ClassVar[Mapping[str, str]] = {}
    """Other top-level spellings of a legacy section (``{"hub": "distributed"}``), used
    when the canonical key is absent."""

    @classmethod
    def options_from_legacy(
        cls, sections: LegacySections, options: Mapping[str, object] | None
    ) -> PluginOptions | None:
        """The one place a plugin rewrites its 2.0 sections into its options.

        ``options`` are those of the plugin's ``callbacks:`` entry, or ``None`` when the
        config does not name it. Return the options to build the plugin with, or ``None``
        to leave an unnamed plugin out. The default: a named plugin gets its own options,
        an unnamed one is added (with no options) only when ``enabled_by_default``.
        """
        del sections
        if options is not None:
            return dict(options)
        return {} if cls.enabled_by_default else None

    @classmethod
    def build(cls, options: Mapping[str, object], context: PluginContext) -> Callback:
        """Build the callback of one ``callbacks:`` entry (what the runtime calls). The
        default is ``from_options``; a plugin whose options choose among several callback
        classes overrides this builder, so that ``from_options`` always returns ``cls``."""
        return cls.from_options(options, context)

    @classmethod
    def normalise_legacy(cls, data: dict[str, object]) -> None:
        """Rewrite the plugin's 2.0 keys in a raw config mapping, in place, before
        validation (case folding, derived values). Must be idempotent, must leave values
        of a wrong type alone (the schema reports them) and never raise. Default: nothing."""
        del data

    @classmethod
    def legacy_errors(cls, sections: LegacySections) -> Iterator[str]:
        """Cross-field rules of the plugin's 2.0 sections, run after the schema pass of
        every config (installed plugins only). Yield messages starting with their path
        (``distributed.hub_dir: ...``). Default: none."""
        del sections
        return iter(())

    @classmethod
    def options_errors(
        cls, entry: str, options: Mapping[str, object], sections: LegacySections
    ) -> Iterator[str]:
        """Cross-field rules of one ``callbacks:`` entry naming this plugin, run after the
        schema pass; ``entry`` is its path (``callbacks[2]``), to start each message with.
        ``sections`` are the plugin's 2.0 sections. Default: none."""
        del entry, options, sections
        return iter(())

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
