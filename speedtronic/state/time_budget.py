"""A job's time budget: durations as people and schedulers write them, and how a run that
spent its budget ends.

``run.max_time: "3h50m"`` (or ``speedtronic fit --max-time 3h50m``) stops a run cleanly
after the step during which the budget runs out, with a final checkpoint, and the CLI exits
with ``TIME_BUDGET_EXIT_CODE`` so that a wrapper resubmits the job, which continues with
``--resume``. The ``time_budget`` callback does the stopping; this module is what the
config, the CLI and the checkpoint callback share: ``parse_duration`` and the stop reason
(``time_budget_stop_reason``, recognised by ``is_time_budget_stop`` and by
``speedtronic.state.checkpoint.requeue_exit_code``).

Accepted durations (``parse_duration``)::

    90            a number: seconds (not SLURM's minutes)      90.0
    "90s" "45m" "3h50m" "1d2h" "1.5h" "2h 30m"               units d, h, m, s, largest first
    "03:50:00" "1-02:00:00" "50:00" "1-02"                   SLURM's [days-]hours:minutes:seconds,
                                                             minutes:seconds, days-hours[:minutes]

(YAML 1.1 reads an unquoted ``3:50:00`` as the number 13800 -- base 60 -- which is the same
duration; ``03:50:00`` stays a string.)
"""

from __future__ import annotations

import math
import re

__all__ = [
    "MIN_TIME_BUDGET_S",
    "TIME_BUDGET_EXIT_CODE",
    "DurationError",
    "describe_duration",
    "is_time_budget_stop",
    "parse_duration",
    "time_budget_stop_reason",
]

TIME_BUDGET_EXIT_CODE = 75
"""The exit status of a run that stopped because its time budget was spent: ``EX_TEMPFAIL``
of ``sysexits.h`` ("a temporary failure; the user is invited to retry"). Distinct from a
signal's 128 + N (143 for SIGTERM), so a wrapper can tell a planned stop from a preemption;
both mean "requeue me and resume"."""

MIN_TIME_BUDGET_S = 1.0
"""A shorter ``run.max_time`` is refused when the config is validated: no step fits in it."""

_MAX_DURATION_S = 366 * 86400.0
"""A longer duration is a typo (and large numbers would overflow the clock arithmetic)."""

_NUMBER = r"\d+(?:\.\d+)?"
_SECONDS = re.compile(_NUMBER)
_UNITS = re.compile(
    rf"(?:(?P<d>{_NUMBER})\s*d)?\s*(?:(?P<h>{_NUMBER})\s*h)?\s*"
    rf"(?:(?P<m>{_NUMBER})\s*m)?\s*(?:(?P<s>{_NUMBER})\s*s)?",
    re.IGNORECASE,
)
_CLOCK = re.compile(r"(?:(?P<days>\d+)-)?(?P<first>\d+)(?::(?P<second>\d\d))?(?::(?P<third>\d\d))?")
_UNIT_SECONDS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
_MAX_TEXT = 64
_REASON_PREFIX = "time budget "


class DurationError(ValueError):
    """A value that is not a duration; the message says which forms are."""


def _problem(value: object, why: str = "is not a duration") -> DurationError:
    shown = repr(value) if len(repr(value)) <= _MAX_TEXT else repr(value)[:_MAX_TEXT] + "..."
    return DurationError(
        f"{shown} {why}: write it like 90s, 45m, 3h50m, 1d2h, 03:50:00 (SLURM's "
        "[days-]hours:minutes:seconds) or as a number of seconds"
    )


def parse_duration(value: object) -> float:
    """Seconds in ``value``: a positive number of seconds, or a string in one of the forms
    of the module docstring. ``DurationError`` for anything else (also zero, negative, or
    more than ``_MAX_DURATION_S``). Bounded work for any input."""
    if isinstance(value, bool):
        raise _problem(value)
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and len(value) <= _MAX_TEXT:
        seconds = _parse_text(value.strip(), value)
    else:
        raise _problem(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise _problem(value, "is not a positive duration")
    if seconds > _MAX_DURATION_S:
        raise _problem(value, f"is longer than {_MAX_DURATION_S / 86400:.0f} days")
    return seconds


def _parse_text(text: str, value: object) -> float:
    if _SECONDS.fullmatch(text):
        return float(text)
    units = _UNITS.fullmatch(text)
    if units is not None and any(units.group(unit) for unit in _UNIT_SECONDS):
        return sum(
            float(units.group(unit)) * scale
            for unit, scale in _UNIT_SECONDS.items()
            if units.group(unit)
        )
    clock = _CLOCK.fullmatch(text)
    if clock is not None:
        return _clock_seconds(clock, value)
    raise _problem(value)


def _clock_seconds(clock: re.Match[str], value: object) -> float:
    """SLURM's forms: ``D-H``, ``D-H:M``, ``D-H:M:S``, ``M:S``, ``H:M:S`` (a field after the
    first is two digits below 60)."""
    days, first = clock.group("days"), int(clock.group("first"))
    second, third = clock.group("second"), clock.group("third")
    later = [int(field) for field in (second, third) if field is not None]
    if any(field >= 60 for field in later):
        raise _problem(value)
    if days is not None:  # days-hours[:minutes[:seconds]]
        fields = [first, *later, 0, 0][:3]
        return int(days) * 86400.0 + fields[0] * 3600.0 + fields[1] * 60.0 + fields[2]
    if third is not None:  # hours:minutes:seconds
        return first * 3600.0 + later[0] * 60.0 + later[1]
    if second is not None:  # minutes:seconds
        return first * 60.0 + later[0]
    raise _problem(value)  # a bare number was taken above


def describe_duration(seconds: float) -> str:
    """``13800.0`` -> ``3h50m``, ``90.0`` -> ``1m30s``, ``0.25`` -> ``0.25s``: the shortest
    unit form of ``parse_duration``'s (fractions of a second kept to two places)."""
    if seconds < 60:
        return f"{seconds:.2f}".rstrip("0").rstrip(".") + "s"
    whole = round(seconds)
    parts = []
    for unit, scale in _UNIT_SECONDS.items():
        count, whole = divmod(whole, int(scale))
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)


def time_budget_stop_reason(budget_s: float) -> str:
    """The stop reason of a fit that spent its time budget (``"time budget 3h50m
    spent"``), in the form ``is_time_budget_stop`` (and ``requeue_exit_code``) reads back."""
    return f"{_REASON_PREFIX}{describe_duration(budget_s)} spent"


def is_time_budget_stop(stop_reason: str | None) -> bool:
    """Whether a fit stopped because its time budget was spent."""
    return bool(stop_reason) and str(stop_reason).startswith(_REASON_PREFIX)
