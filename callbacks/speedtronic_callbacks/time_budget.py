"""``time_budget``: stop cleanly when the job's wall-clock budget is spent.

    run:
      max_time: 3h50m           # or: speedtronic fit --max-time 3h50m

The plugin is in a run exactly when ``run.max_time`` is set (or when ``callbacks:`` names
it with a ``max_time``); without one it is not built, so a run without a budget pays
nothing for it. With one, every step ends with one ``time.monotonic()`` read: after the step
during which the budget runs out the callback asks the trainer to stop
(``trainer.request_stop("time budget 3h50m spent")``), the fit ends normally, the
checkpoint callback writes the final checkpoint (also with ``save_final: false``) and
``speedtronic fit`` exits 75 (``speedtronic.state.time_budget.TIME_BUDGET_EXIT_CODE``) for a
wrapper to resubmit the job with ``--resume``.

The clock starts when the callback is built: in ``speedtronic fit`` right after the config
is read, before the model, the data and the resume (a download from ``checkpoint.remote``
counts against the budget); interpreter start-up and imports (seconds) do not. A resumed
job is a new process with a fresh budget. ``started_at`` (``time.monotonic()`` seconds)
sets the start from Python.

A budget shorter than one step still trains one: the first step of the fit always runs
(each resubmission makes progress), and if the budget was already spent when it ended the
run says so in one warning. ``run.max_time`` below one second is refused when the config is
validated.

Multi-rank runs: rank 0's clock decides, broadcast at planned decision steps only
(``speedtronic_callbacks.wall_clock.Deadline``), so every rank requests the stop at the same
step with the same reason; the stop takes effect at the next logging step, where the ranks
agree on every stop (``logging.every_steps``: leave that many steps of margin).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from speedtronic.config.declare import Opt, plugin
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import FitContext, StepContext
from speedtronic.plugins import JSONSchema, PluginOptions, SectionData, Sections, keys_of
from speedtronic.state.time_budget import (
    MIN_TIME_BUDGET_S,
    DurationError,
    describe_duration,
    parse_duration,
    time_budget_stop_reason,
)
from speedtronic_callbacks.wall_clock import Deadline

if TYPE_CHECKING:
    from speedtronic.engine.view import TrainerView

__all__ = ["TimeBudget", "TimeBudgetOptions"]

logger = logging.getLogger("speedtronic.time_budget")

_DURATION: JSONSchema = {"type": ["string", "number"], "minLength": 1, "exclusiveMinimum": 0}


@dataclass(frozen=True)
class RunKeys:
    """The key this plugin adds to the core ``run:`` section."""

    max_time: Annotated[
        str | float | None,
        Opt(
            "Wall-clock budget of the job: stop cleanly after the step during which it runs "
            "out, save, exit 75 (requeue). 90s, 45m, 3h50m, 1d2h, 03:50:00 or seconds; null: "
            "no budget.",
            schema={**_DURATION, "type": ["string", "number", "null"]},
        ),
    ] = None


def _check_max_time(value: object) -> float:
    """Seconds of a ``max_time`` value; ``DurationError`` for one that is not a duration or
    is shorter than ``MIN_TIME_BUDGET_S`` (no step fits in it)."""
    seconds = parse_duration(value)
    if seconds < MIN_TIME_BUDGET_S:
        raise DurationError(
            f"{value!r} is shorter than one second: a time budget must leave room for at "
            "least one step"
        )
    return seconds


@dataclass(frozen=True)
class TimeBudgetOptions:
    """The ``time_budget`` plugin's option (its default: ``run.max_time``)."""

    max_time: Annotated[
        str | float,
        Opt(
            "wall-clock budget: `90s`, `45m`, `3h50m`, `1d2h`, `03:50:00` or seconds, at "
            "least 1 s (default: `run.max_time`)",
            schema=_DURATION,
            type_text="duration",
        ),
    ]


def options_from_section(
    sections: SectionData, options: Mapping[str, object] | None
) -> PluginOptions | None:
    """``run.max_time`` adds the plugin (and is the default of a named entry's
    ``max_time``); without it the plugin is left out."""
    max_time = keys_of(sections, "run", RunKeys).max_time
    merged: PluginOptions = {} if max_time is None else {"max_time": max_time}
    if options is None:
        return merged or None
    merged.update(options)
    return merged


def section_errors(sections: SectionData) -> Iterator[str]:
    max_time = keys_of(sections, "run", RunKeys).max_time
    if max_time is not None:
        yield from _duration_errors("run.max_time", max_time)


def options_errors(
    entry: str, options: Mapping[str, object], sections: SectionData
) -> Iterator[str]:
    del sections
    if "max_time" in options:
        yield from _duration_errors(f"{entry}.max_time", options["max_time"])


@plugin(
    "time_budget",
    options=TimeBudgetOptions,
    sections=Sections(
        keys=("run",),
        declared={"run": RunKeys},
        to_options=options_from_section,
        errors=section_errors,
    ),
    options_errors=options_errors,
    implied_order=95,  # after the checkpoint plugin: the stop is after the step
)
class TimeBudget(Callback):
    """Stops the fit after the step during which ``max_time`` (a duration) is spent."""

    def __init__(self, max_time: str | float, *, started_at: float | None = None) -> None:
        self.budget_s = _check_max_time(max_time)
        self.started_at = time.monotonic() if started_at is None else started_at
        self.stopped_at_step: int | None = None
        """The step after which the budget stopped the fit (``None``: it did not)."""
        self.clock = Deadline()
        """The deadline asked every step (its ``decisions``: broadcasts in a multi-rank run)."""
        self._first_step = 1

    @property
    def deadline(self) -> float:
        """When the budget runs out (``time.monotonic()`` seconds)."""
        return self.started_at + self.budget_s

    def on_setup(self, trainer: TrainerView, ctx: FitContext) -> None:
        self.stopped_at_step = None
        self._first_step = ctx.start_step + 1
        self.clock = Deadline(trainer.distributed)
        self.clock.start_at(self.deadline, step=ctx.start_step)

    def on_step_end(self, trainer: TrainerView, ctx: StepContext) -> None:
        if self.stopped_at_step is not None or not self.clock.passed(ctx.step):
            return
        self.stopped_at_step = ctx.step
        budget = describe_duration(self.budget_s)
        trainer.request_stop(time_budget_stop_reason(self.budget_s))
        if ctx.step == self._first_step:
            warnings.warn(
                f"time budget {budget} is shorter than one step: it was spent when the first "
                f"step of this fit (step {ctx.step}) ended, "
                f"{time.monotonic() - self.started_at:.1f} s after the run started; stopping "
                "after it (raise run.max_time: each resubmission makes one step)",
                UserWarning,
                stacklevel=2,
            )
        else:
            logger.warning(
                "time budget %s spent during step %d: stopping after it, saving a checkpoint "
                "and exiting for requeue (resume with --resume)",
                budget,
                ctx.step,
            )


def _duration_errors(path: str, value: object) -> Iterator[str]:
    try:
        _check_max_time(value)
    except DurationError as exc:
        yield f"{path}: {exc}"
