"""Event filters: when a callback's per-step hooks are due.

A callback declares, per event, on which global steps its hook runs; the dispatch plan does not
call it on other steps (in the spirit of Ignite's ``Events.ITERATION_COMPLETED(every=N)``)::

    class Sink(Callback):
        due_when = {Event.METRICS: logging_steps()}     # the logging cadence: every
                                                         # metrics_every, evaluations, the last

    class Probe(Callback):
        def __init__(self, n: int) -> None:
            self.due_when = {Event.STEP_END: every(n) | final_step()}

Filters combine with ``|`` (a hook is due when any part is). They apply to the events inside a
global step (``speedtronic.engine.events.STEP_EVENTS``); fit-level events run once anyway.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from speedtronic.engine.events import Event

__all__ = [
    "METRICS_ON_LOGGING_STEPS",
    "StepFilter",
    "every",
    "final_step",
    "logging_steps",
    "never",
    "once",
]


@dataclass(frozen=True, slots=True)
class StepFilter:
    """The steps a hook is due on: multiples of ``every``, the steps in ``at``, the fit's
    final step (``final``), the logging cadence (``logging``: every ``metrics_every`` steps
    and the final step). Build it with ``every``, ``once``, ``final_step``, ``logging_steps``."""

    every: int | None = None
    at: frozenset[int] = frozenset()
    final: bool = False
    logging: bool = False

    def __post_init__(self) -> None:
        if self.every is not None and self.every < 1:
            raise ValueError(f"every must be >= 1, got {self.every}")

    def __or__(self, other: StepFilter) -> StepFilter:
        if self.every is not None and other.every is not None and self.every != other.every:
            raise ValueError(
                f"cannot combine every({self.every}) with every({other.every}); use one cadence"
            )
        return StepFilter(
            every=self.every if self.every is not None else other.every,
            at=self.at | other.at,
            final=self.final or other.final,
            logging=self.logging or other.logging,
        )

    def due(self, step: int, target_step: int, metrics_every: int, eval_every: int = 0) -> bool:
        """Whether a hook with this filter runs at global step ``step`` (``eval_every``: the
        evaluation cadence, 0 when evaluation is off; evaluation steps are logging steps)."""
        if self.every is not None and step % self.every == 0:
            return True
        if step in self.at:
            return True
        if (self.final or self.logging) and step == target_step:
            return True
        if not self.logging:
            return False
        return step % metrics_every == 0 or (eval_every > 0 and step % eval_every == 0)

    @property
    def is_never(self) -> bool:
        """Due on no step at all (``never()``): the plan does not bind the hook."""
        return self.every is None and not self.at and not self.final and not self.logging

    def next_due(
        self, step: int, target_step: int, metrics_every: int, eval_every: int = 0
    ) -> int | None:
        """The first step ``>= step`` this filter is due on (``None``: never again), so the
        plan can skip re-evaluating filters on the steps in between."""
        candidates: list[int] = [s for s in self.at if s >= step]
        if self.every is not None:
            candidates.append(-(-step // self.every) * self.every)
        if (self.final or self.logging) and target_step >= step:
            candidates.append(target_step)
        if self.logging:
            candidates.append(-(-step // metrics_every) * metrics_every)
            if eval_every > 0:
                candidates.append(-(-step // eval_every) * eval_every)
        return min(candidates, default=None)

    def describe(self) -> str:
        parts = []
        if self.every is not None:
            parts.append(f"every {self.every}")
        if self.at:
            parts.append("at " + ",".join(str(s) for s in sorted(self.at)))
        if self.logging:
            parts.append("logging steps")
        elif self.final:
            parts.append("final step")
        return " | ".join(parts) or "never"


def every(n: int) -> StepFilter:
    """Due on steps that are multiples of ``n``."""
    return StepFilter(every=n)


def once(step: int) -> StepFilter:
    """Due at global step ``step`` only."""
    return StepFilter(at=frozenset({step}))


def final_step() -> StepFilter:
    """Due on the fit's final step (the target step) only."""
    return StepFilter(final=True)


def never() -> StepFilter:
    """Due on no step: switches a hook off for one instance (e.g. a feature whose option is
    unset), so the event costs nothing for it -- the plan does not even bind the hook."""
    return StepFilter()


def logging_steps() -> StepFilter:
    """Due on the run's logging cadence: every ``metrics_every`` steps, every evaluation step
    and the final step (exactly the steps where ``MetricsContext.due`` is true)."""
    return StepFilter(logging=True)


def _metrics_on_logging_steps() -> Mapping[Event, StepFilter]:
    return MappingProxyType({Event.METRICS: logging_steps()})


METRICS_ON_LOGGING_STEPS: Mapping[Event, StepFilter] = _metrics_on_logging_steps()
"""``due_when`` of a callback whose ``on_metrics`` only matters on logging steps (sinks,
contributors of logged-only keys)."""
