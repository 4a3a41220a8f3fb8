"""Event dispatch: which callback hooks run for each event, in which order.

The plan is computed once per fit. A callback that does not override a hook is not in
that event's list, so an unused hook costs nothing on the hot path. Observer callbacks
(sinks, loggers) are wrapped so that a failure is reported once as a warning and training
continues; any other callback's failure propagates and stops the run.

In a distributed run the plan of each rank holds only the callbacks whose ``rank_policy``
selects that rank (``runs_on_rank``): sinks run on rank 0 alone, without any rank checks of
their own. Every rank still *owns* all callbacks (their state is saved and restored).
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol, TypeVar

from speedtronic.engine.callback import Callback, RankPolicy
from speedtronic.engine.contexts import (
    BackwardContext,
    CheckpointContext,
    CoordinateContext,
    MetricsContext,
    MicrobatchContext,
    OptimizerStepContext,
    SchedulerContext,
    StepContext,
)
from speedtronic.engine.events import EVENT_KEYS, FIT_EVENTS, Event, EventKey, EventSpec
from speedtronic.engine.filters import StepFilter
from speedtronic.user_warnings import warn_at_failure

if TYPE_CHECKING:
    from speedtronic.engine.view import TrainerView

_BoundHook = Callable[["TrainerView", object], None]
"""A callback's hook method bound to its instance, as the dispatch plan calls it
(not ``speedtronic.hooks``, the 2.0 metric-logger hooks)."""
CtxT = TypeVar("CtxT")


EventHooks = tuple[Callable[["TrainerView", CtxT], None], ...]
"""The due hooks of one event, typed by its context (what ``HookTable`` hands out)."""


class HookTable(Protocol):
    """The hooks due in the current step, per event key, as the loop reads them.

    At runtime it is a plain ``dict`` (one C-level lookup per event on the hot path; the
    loop calls the hooks itself instead of going through ``CallbackPlan.emit``). For mypy,
    indexing it with a typed key such as ``On.STEP_END`` gives hooks that take that event's
    context only, so calling them with the wrong context is a type error -- the same
    guarantee ``emit`` gives."""

    def __getitem__(self, key: EventSpec[CtxT], /) -> EventHooks[CtxT]: ...


_HOOK_NAMES: frozenset[str] = frozenset(event.hook_name for event in Event)

_IN_ORDER = list(Event)
_STEP_HOOK_KEYS: tuple[EventKey, ...] = tuple(
    EVENT_KEYS[event]
    for event in _IN_ORDER[_IN_ORDER.index(Event.STEP_START) : _IN_ORDER.index(Event.STEP_END) + 1]
    if event not in (Event.OPTIMIZER_RESET, Event.EVAL_START, Event.EVAL_END)
)
"""The events the loop calls from its hook table (``optimizer_reset`` and the evaluation
events go through ``emit``, on the steps that have them)."""


class StepHooks(NamedTuple):
    """The hooks due in the current step of each in-step event (``_STEP_HOOK_KEYS``, in
    order), typed by the event's context: the loop unpacks the whole step's hooks into
    locals at once instead of looking each event up in the ``HookTable``."""

    step_start_hooks: EventHooks[StepContext]
    microbatch_start_hooks: EventHooks[MicrobatchContext]
    before_backward_hooks: EventHooks[BackwardContext]
    after_backward_hooks: EventHooks[BackwardContext]
    microbatch_end_hooks: EventHooks[MicrobatchContext]
    before_optimizer_step_hooks: EventHooks[OptimizerStepContext]
    after_optimizer_step_hooks: EventHooks[OptimizerStepContext]
    after_scheduler_step_hooks: EventHooks[SchedulerContext]
    coordinate_hooks: EventHooks[CoordinateContext]
    metrics_hooks: EventHooks[MetricsContext]
    checkpoint_hooks: EventHooks[CheckpointContext]
    step_end_hooks: EventHooks[StepContext]


assert StepHooks._fields == tuple(f"{key.event.value}_hooks" for key in _STEP_HOOK_KEYS)


def _step_hooks(table: dict[EventKey, tuple[_BoundHook, ...]]) -> StepHooks:
    return StepHooks(*(table[key] for key in _STEP_HOOK_KEYS))


_METRICS_INDEX = StepHooks._fields.index("metrics_hooks")


def _only_metrics(hooks: StepHooks) -> bool:
    """Hooks of ``metrics`` are due, and of no other in-step event (sinks on a logging
    step): the loop's lean path calls them (``CallbackPlan.step_metrics_only``)."""
    return (
        bool(hooks.metrics_hooks)
        and not any(hooks[:_METRICS_INDEX])
        and not any(hooks[_METRICS_INDEX + 1 :])
    )


class CallbackWarning(UserWarning):
    """An observer callback failed; training continued."""


class DuplicateStateKeyError(ValueError):
    """Two callbacks share a ``state_key``: their checkpoints would overwrite each other."""


class FilterError(ValueError):
    """A callback's ``due_when`` names an event it cannot filter or does not listen to."""


def _check_filters(callback: Callback) -> None:
    """Raise ``FilterError`` for a filter on a fit-level event or on a hook not overridden."""
    for event in callback.due_when:
        if event in FIT_EVENTS:
            raise FilterError(
                f"callback {callback.display_name!r} filters {event.value!r}, a fit-level event "
                "that runs once; filters apply to the events inside a global step"
            )
        if not overrides(callback, event):
            raise FilterError(
                f"callback {callback.display_name!r} declares when {event.hook_name} is due "
                "but does not define it"
            )


class UnknownHookError(TypeError):
    """A callback defines an ``on_*`` method that is not an event's hook (a typo would
    otherwise never be called)."""


def _unknown_hooks(cls: type[Callback]) -> list[str]:
    """``on_*`` methods of ``cls`` (and its bases below ``Callback``) that are no event's hook."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is Callback or not issubclass(klass, Callback):
            continue
        names.update(
            name
            for name, value in vars(klass).items()
            if name.startswith("on_") and name not in _HOOK_NAMES and callable(value)
        )
    return sorted(names)


def _check_hook_names(cls: type[Callback], display_name: str | None = None) -> None:
    """Raise ``UnknownHookError`` naming the first ``on_*`` method of ``cls`` that is not an
    event hook, with the nearest event hook as a suggestion."""
    unknown = _unknown_hooks(cls)
    if not unknown:
        return
    name = unknown[0]
    close = difflib.get_close_matches(name, sorted(_HOOK_NAMES), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    code = getattr(getattr(cls, name), "__code__", None)
    where = (
        f"{code.co_filename}:{code.co_firstlineno}"
        if code is not None
        else f"{cls.__module__}.{cls.__qualname__}"
    )
    raise UnknownHookError(
        f"callback {display_name or cls.__name__!r} defines {name!r} (at {where}), which is "
        f"not an event hook: {hint}(hooks are on_<event> for the events in "
        "speedtronic.engine.events.Event; rename the method, or drop the on_ prefix for a helper)"
    )


@dataclass(frozen=True)
class HookFailure:
    """A hook that raised during an isolated emit (``CallbackPlan.emit_isolated``)."""

    callback: str
    event: Event
    error: BaseException

    def describe(self) -> str:
        return (
            f"callback {self.callback!r} also failed in {self.event.value!r}: "
            f"{type(self.error).__name__}: {self.error}"
        )


def attach_failures(error: BaseException, failures: Sequence[HookFailure]) -> None:
    """Attach later hook failures to ``error`` as notes: the user sees the original error
    first and every later failure below it, none replacing it."""
    for failure in failures:
        if failure.error is not error:
            error.add_note(failure.describe())


def overrides(callback: Callback, event: Event) -> bool:
    """True when ``callback``'s class overrides the hook of ``event``."""
    name = event.hook_name
    return getattr(type(callback), name) is not getattr(Callback, name)


class _GuardedHook:
    """Runs an observer's hook; a failure warns once per (callback, event) and is swallowed."""

    __slots__ = ("_hook", "_callback", "_event", "_reported")

    def __init__(self, hook: _BoundHook, callback: Callback, event: Event) -> None:
        self._hook = hook
        self._callback = callback
        self._event = event
        self._reported = False

    def __call__(self, trainer: TrainerView, ctx: object) -> None:
        try:
            self._hook(trainer, ctx)
        except Exception as exc:  # observers never stop training (DESIGN §3)
            if not self._reported:
                self._reported = True
                # Reported at the line of the user's hook that raised (or, for a built-in,
                # at the user's line that started the fit), not here.
                warn_at_failure(
                    f"callback {self._callback.display_name!r} failed in "
                    f"{self._event.value!r}: {type(exc).__name__}: {exc} "
                    "(training continues; further failures of this hook are not reported)",
                    CallbackWarning,
                    exc,
                    self._hook,
                )


def runs_on_rank(policy: RankPolicy, rank: int, local_rank: int) -> bool:
    """Whether a callback with ``policy`` runs on global ``rank`` / node-local ``local_rank``."""
    if policy == "all":
        return True
    if policy == "main":
        return rank == 0
    if policy == "local_main":
        return local_rank == 0
    raise ValueError(f"unknown rank_policy {policy!r} (expected 'all', 'main' or 'local_main')")


def _listens(callback: Callback, event: Event) -> bool:
    """Overrides ``event``'s hook and has not switched it off with a ``never()`` filter."""
    if not overrides(callback, event):
        return False
    when = callback.due_when.get(event)
    return when is None or not when.is_never


def _ordered_for(event: Event, callbacks: Sequence[Callback]) -> list[Callback]:
    listening = [cb for cb in callbacks if _listens(cb, event)]
    if event is Event.METRICS:
        # Contributors first, then sinks, each group in the given order.
        contributors = [cb for cb in listening if cb.metrics_phase == "contribute"]
        sinks = [cb for cb in listening if cb.metrics_phase == "consume"]
        return contributors + sinks
    return listening


class CallbackPlan:
    """The per-event hook lists of one set of callbacks, for one rank (default: rank 0 of a
    single-process run, where every callback runs)."""

    def __init__(
        self, callbacks: Sequence[Callback], *, rank: int = 0, local_rank: int = 0
    ) -> None:
        for callback in callbacks:
            _check_hook_names(type(callback), callback.display_name)
            _check_filters(callback)
        check_state_keys(callbacks)
        self.callbacks: tuple[Callback, ...] = tuple(callbacks)
        self.rank = rank
        self.local_rank = local_rank
        active = [cb for cb in callbacks if runs_on_rank(cb.rank_policy, rank, local_rank)]
        self._order: dict[Event, tuple[Callback, ...]] = {}
        self._hooks: dict[Event, tuple[_BoundHook, ...]] = {}
        self._by_key: dict[EventKey, tuple[_BoundHook, ...]] = {}
        # Events with at least one filtered hook: (filter or None, hook), in order.
        self._filtered: dict[EventKey, tuple[tuple[StepFilter | None, _BoundHook], ...]] = {}
        for event in Event:
            ordered = _ordered_for(event, active)
            self._order[event] = tuple(ordered)
            self._hooks[event] = tuple(self._bind(cb, event) for cb in ordered)
            self._by_key[EVENT_KEYS[event]] = self._hooks[event]
            filters = [cb.due_when.get(event) for cb in ordered]
            if any(f is not None for f in filters):
                self._filtered[EVENT_KEYS[event]] = tuple(
                    zip(filters, self._hooks[event], strict=True)
                )
        self.filtered = bool(self._filtered)
        """Some hook has a ``due_when`` filter: without one the due hooks are the same on
        every step and ``begin_step`` need not be called."""
        # The hooks due in the current step, per event key (``begin_step``); the loop reads
        # it to skip events nobody is due to hear. The full lists until a step begins.
        self._due: dict[EventKey, tuple[_BoundHook, ...]] = self._by_key
        # A step where no filtered hook is due gets the unfiltered hooks only; steps in
        # [_quiet_from, _quiet_until) for one (target, cadences) are such steps (begin_step).
        self._quiet_hooks: dict[EventKey, tuple[_BoundHook, ...]] = dict(self._by_key)
        for key, entries in self._filtered.items():
            self._quiet_hooks[key] = tuple(hook for when, hook in entries if when is None)
        self._quiet_from = self._quiet_until = 0
        self._quiet_for = (0, 0, 0)  # (target, metrics cadence, evaluation cadence)
        self._quiet_step_hooks = _step_hooks(self._quiet_hooks)
        self._quiet_idle = not any(self._quiet_step_hooks)
        self._quiet_metrics_only = _only_metrics(self._quiet_step_hooks)
        # The distinct filters, one bit each (all sinks share one ``logging_steps()``): the
        # hooks due in a step depend only on which filters are due, so the table of each
        # such set is built once (``_due_tables``) and a due step evaluates each filter once.
        distinct = dict.fromkeys(
            when for entries in self._filtered.values() for when, _ in entries if when is not None
        )
        self._filter_bits: dict[StepFilter, int] = {
            when: 1 << index for index, when in enumerate(distinct)
        }
        self._due_tables: dict[
            int, tuple[dict[EventKey, tuple[_BoundHook, ...]], StepHooks, bool, bool]
        ] = {}
        self.step_hooks = _step_hooks(self._by_key)
        """The in-step events' hooks due in the current step (``begin_step``), as the loop
        unpacks them."""
        self.step_idle = not any(self.step_hooks)
        """No hook of an in-step event (``_STEP_HOOK_KEYS``) is due in the current step
        (``begin_step``): the loop then runs the step without consulting the table."""
        self.step_metrics_only = _only_metrics(self.step_hooks)
        """Only ``metrics`` hooks are due among the in-step events in the current step
        (``begin_step``; sinks on a logging step): the loop runs the step as an idle one and
        calls them from ``step_hooks.metrics_hooks``."""

    @staticmethod
    def _bind(callback: Callback, event: Event) -> _BoundHook:
        hook: _BoundHook = getattr(callback, event.hook_name)
        return _GuardedHook(hook, callback, event) if callback.is_observer else hook

    def hooks(self, event: Event) -> tuple[_BoundHook, ...]:
        """The hooks to call for ``event``, in order (empty when nobody listens)."""
        return self._hooks[event]

    def listens(self, event: Event) -> bool:
        """Whether any callback listens to ``event`` at all (on any step)."""
        return bool(self._hooks[event])

    def begin_step(
        self, step: int, target_step: int, metrics_every: int, eval_every: int = 0
    ) -> HookTable:
        """Select the hooks due in global step ``step`` (their ``due_when`` filters) and
        return them per event key (also ``due_hooks`` until the next step begins). Without
        filtered callbacks every hook is due on every step.

        Filters are sparse (every N steps, logging steps, the final step), so most steps
        have none due: the plan remembers the stretch of steps until the next one that is
        and hands out the same "only unfiltered hooks" table there, without evaluating a
        filter or building a table per step. On a step where some are due (every step, with
        ``metrics_every: 1`` and sinks), each distinct filter is evaluated once and the table
        of that set of due filters, built on its first step, is handed out again."""
        if not self._filtered:
            return self._due
        if (
            self._quiet_from <= step < self._quiet_until
            and (target_step, metrics_every, eval_every) == self._quiet_for
        ):
            if self._due is not self._quiet_hooks:  # a step with filtered hooks due came between
                self.step_idle = self._quiet_idle
                self.step_metrics_only = self._quiet_metrics_only
                self.step_hooks = self._quiet_step_hooks
                self._due = self._quiet_hooks
            return self._due
        due_filters = 0
        for when, bit in self._filter_bits.items():
            if when.due(step, target_step, metrics_every, eval_every):
                due_filters |= bit
        if not due_filters:
            next_due = self._next_due(step, target_step, metrics_every, eval_every)
            self._quiet_from, self._quiet_until = step, next_due or sys.maxsize
            self._quiet_for = (target_step, metrics_every, eval_every)
            self.step_idle = self._quiet_idle
            self.step_metrics_only = self._quiet_metrics_only
            self.step_hooks = self._quiet_step_hooks
            self._due = self._quiet_hooks
            return self._due
        tables = self._due_tables.get(due_filters) or self._due_table(due_filters)
        self._due, self.step_hooks, self.step_idle, self.step_metrics_only = tables
        return self._due

    # The two helpers below hold the generators that ``begin_step`` would otherwise close
    # over its arguments with: a closure makes a cell of each variable on every call.

    def _next_due(
        self, step: int, target_step: int, metrics_every: int, eval_every: int
    ) -> int | None:
        """The first step ``>= step`` on which some filter is due (``None``: none again)."""
        return min(
            (
                due_at
                for when in self._filter_bits
                if (due_at := when.next_due(step, target_step, metrics_every, eval_every))
                is not None
            ),
            default=None,
        )

    def _due_table(
        self, due_filters: int
    ) -> tuple[dict[EventKey, tuple[_BoundHook, ...]], StepHooks, bool, bool]:
        """The table of a step on which the filters of the bits in ``due_filters`` are due,
        with its ``step_hooks``, ``step_idle`` and ``step_metrics_only`` (kept for the next
        such step)."""
        current = dict(self._by_key)
        for key, entries in self._filtered.items():
            current[key] = tuple(
                hook
                for when, hook in entries
                if when is None or self._filter_bits[when] & due_filters
            )
        step_hooks = _step_hooks(current)
        tables = (current, step_hooks, not any(step_hooks), _only_metrics(step_hooks))
        self._due_tables[due_filters] = tables
        return tables

    @property
    def due_hooks(self) -> HookTable:
        """The hooks due in the current step, per event key (see ``HookTable``)."""
        return self._due

    def due(self, key: EventKey) -> bool:
        """Whether any hook of ``key``'s event is due in the current step."""
        return bool(self._due[key])

    def emit(self, trainer: TrainerView, key: EventSpec[CtxT], ctx: CtxT) -> None:
        """Call the hooks of ``key``'s event that are due in the current step with ``ctx``
        (typed: mypy rejects a context that is not the event's, see
        ``speedtronic.engine.events.On``)."""
        for hook in self._due[key]:
            hook(trainer, ctx)

    def emit_isolated(
        self, trainer: TrainerView, key: EventSpec[CtxT], ctx: CtxT
    ) -> list[HookFailure]:
        """Call every hook of ``key``'s event even when some raise; returns the failures in
        order (for ``fit_end``, ``exception`` and ``teardown``: one failing callback must not
        keep the others from saving, closing files or stopping threads)."""
        failures: list[HookFailure] = []
        for callback, hook in zip(self._order[key.event], self._due[key], strict=True):
            try:
                hook(trainer, ctx)
            except BaseException as exc:  # every hook runs; the caller decides what to raise
                failures.append(HookFailure(callback.display_name, key.event, exc))
        return failures

    def describe(self) -> list[tuple[Event, list[str]]]:
        """The plan as (event, callback names) rows, for ``speedtronic validate``."""
        return [(event, [cb.display_name for cb in self._order[event]]) for event in Event]

    def format(self) -> str:
        return format_plan(self.describe())


def describe_classes(named: Sequence[tuple[str, type[Callback]]]) -> list[tuple[Event, list[str]]]:
    """The per-event plan of callback *classes* (``speedtronic validate`` builds nothing)."""
    rows = []
    for event in Event:
        listening = [
            (name, cls)
            for name, cls in named
            if getattr(cls, event.hook_name) is not getattr(Callback, event.hook_name)
        ]
        if event is Event.METRICS:
            listening = [x for x in listening if x[1].metrics_phase == "contribute"] + [
                x for x in listening if x[1].metrics_phase == "consume"
            ]
        names = [_with_filter(name, cls.due_when.get(event)) for name, cls in listening]
        rows.append((event, names))
    for name, cls in named:
        _check_hook_names(cls, name)
    return rows


def _with_filter(name: str, when: StepFilter | None) -> str:
    """``name``, and the steps it is due on when a ``due_when`` filter limits them."""
    return name if when is None else f"{name} [{when.describe()}]"


def format_plan(rows: Sequence[tuple[Event, Sequence[str]]]) -> str:
    """Render plan rows as aligned text, one event per line."""
    return "\n".join(
        f"  {event.value:<22} {' -> '.join(names) if names else '-'}" for event, names in rows
    )


def check_state_keys(callbacks: Sequence[Callback]) -> None:
    """Raise ``DuplicateStateKeyError`` when two callbacks share a state key."""
    seen: dict[str, Callback] = {}
    for callback in callbacks:
        key = callback.state_key
        if key is None:
            continue
        if key in seen:
            raise DuplicateStateKeyError(
                f"callbacks {seen[key].display_name!r} and {callback.display_name!r} both use "
                f"state_key {key!r}; give one of them another state_key"
            )
        seen[key] = callback
