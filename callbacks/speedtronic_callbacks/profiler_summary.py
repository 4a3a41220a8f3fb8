"""The numbers of the ``profiler`` callback's summary line, read from the trace it wrote.

The summary is computed from the Chrome trace file (``traceEvents``), not from
``torch.profiler``'s ``key_averages()``, for two reasons:

* with ``with_stack: true`` torch's Python tracer keeps pointers to the names of the code
  objects it saw; ``key_averages()`` decodes them lazily, and a code object freed since
  (a function made and dropped during the window) leaves freed memory there: a
  ``UnicodeDecodeError`` at the end of the window, and no summary. The trace file was
  written from valid names (it is read here with undecodable bytes replaced);
* ``key_averages()`` mixes the Python-function events into the operators: an event's
  *self* time is its duration minus its children's, and a Python frame's children are
  timed by another clock than the frame, so its self time can come out negative. Summed
  into the total, those made one operator's share of "the total self time" exceed 100%.

Here only operators count: the ``cpu_op`` events, each with its self time (its duration
minus the durations of the operators directly inside it, on its thread; never negative),
and on a GPU the kernels and memory copies, each charged to the operator that launched
it (``External id``). The total is the sum of those self times -- the time spent inside
operators -- so the shares of all operators add up to 100%.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["OperatorTime", "read_trace_events", "top_operators"]

_TraceEvent = Mapping[str, object]
_DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
"""Trace categories of work on the device."""


@dataclass(frozen=True)
class OperatorTime:
    """One operator of a summary: its name and its self time in microseconds."""

    name: str
    self_us: float


def read_trace_events(path: Path) -> list[_TraceEvent]:
    """The ``traceEvents`` of a Chrome trace file (bytes that are not UTF-8 replaced)."""
    trace = json.loads(path.read_bytes().decode("utf-8", errors="replace"))
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise ValueError(f"{path} is not a Chrome trace (no traceEvents list)")
    return [event for event in events if isinstance(event, dict)]


def _number(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _spans(events: Iterable[_TraceEvent], categories: frozenset[str]) -> list[_TraceEvent]:
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in categories]


def _external_id(event: _TraceEvent) -> object:
    args = event.get("args")
    return args.get("External id") if isinstance(args, Mapping) else None


def _cpu_self_times(operators: list[_TraceEvent]) -> list[tuple[str, float]]:
    """(name, self time) of each CPU operator: its duration less those of the operators
    directly inside it on its thread."""
    by_thread: dict[tuple[object, object], list[_TraceEvent]] = defaultdict(list)
    for event in operators:
        by_thread[(event.get("pid"), event.get("tid"))].append(event)
    found: list[tuple[str, float]] = []
    for spans in by_thread.values():
        spans.sort(key=lambda e: (_number(e.get("ts")), -_number(e.get("dur"))))
        inner = [0.0] * len(spans)
        open_spans: list[tuple[float, int]] = []  # (end, index), innermost last
        for index, event in enumerate(spans):
            start, duration = _number(event.get("ts")), _number(event.get("dur"))
            while open_spans and open_spans[-1][0] <= start:
                open_spans.pop()
            if open_spans:
                inner[open_spans[-1][1]] += duration
            open_spans.append((start + duration, index))
        for index, event in enumerate(spans):
            own = _number(event.get("dur")) - inner[index]
            found.append((str(event.get("name")), max(own, 0.0)))
    return found


def _device_times(events: list[_TraceEvent]) -> list[tuple[str, float]]:
    """(name, duration) of each device span, named after the operator that launched it."""
    launcher = {
        _external_id(e): str(e.get("name"))
        for e in _spans(events, frozenset({"cpu_op"}))
        if _external_id(e) is not None
    }
    return [
        (launcher.get(_external_id(e), str(e.get("name"))), _number(e.get("dur")))
        for e in _spans(events, _DEVICE_CATEGORIES)
    ]


def top_operators(
    events: list[_TraceEvent], *, device: bool, count: int
) -> tuple[list[OperatorTime], float]:
    """The ``count`` operators with the most self time in a trace's ``events`` (device
    time with ``device``, else CPU time) and the total self time of all operators (µs)."""
    spent = (
        _device_times(events) if device else _cpu_self_times(_spans(events, frozenset({"cpu_op"})))
    )
    totals: dict[str, float] = defaultdict(float)
    for name, micros in spent:
        totals[name] += micros
    ranked = sorted(totals.items(), key=lambda item: item[1], reverse=True)
    top = [OperatorTime(name, micros) for name, micros in ranked[:count] if micros > 0]
    return top, sum(totals.values())
