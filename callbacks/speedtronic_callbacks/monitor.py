"""Watching one metric key: shared by ``early_stopping`` and the checkpoint's ``best.json``.

A monitored key is read from the finished metric record of a step. Keys of the evaluation
(``eval/*``) exist only in the records of evaluation steps (``MetricsContext.evaluated``),
so they are read there and nowhere else; any other key is read on every logging step. A key
missing from a record where it should be is an error naming the keys present -- at the first
such record, not a silent no-op -- and monitoring an ``eval/*`` key while evaluation is off is
an error before the first step (``check_monitor``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from speedtronic.engine.contexts import MetricsContext

if TYPE_CHECKING:
    from speedtronic.engine.view import TrainerView

__all__ = ["Mode", "MonitorError", "check_monitor", "improves", "read_monitored"]

Mode = Literal["min", "max"]

_EVAL_PREFIX = "eval/"
"""Keys with this prefix come from the evaluation of the held-out set."""


class MonitorError(ValueError):
    """The monitored metric is missing from a record, is not a number, or can never appear."""


def check_monitor(owner: str, key: str, trainer: TrainerView) -> None:
    """``MonitorError`` when ``key`` is an evaluation metric and evaluation is off."""
    if key.startswith(_EVAL_PREFIX) and trainer.eval_every <= 0:
        raise MonitorError(
            f"{owner} monitors {key!r}, an evaluation metric, but evaluation is off: set "
            "eval.every_steps (or Trainer(eval_data=..., eval_every=...))"
        )


def read_monitored(owner: str, key: str, ctx: MetricsContext) -> float | None:
    """The value of ``key`` in this step's record; ``None`` on a step that does not measure
    it (an ``eval/*`` key off an evaluation step). ``MonitorError`` when it should be there
    and is not, or is not a number."""
    if key.startswith(_EVAL_PREFIX) and not ctx.evaluated:
        return None
    if key not in ctx.record:
        keys = ", ".join(sorted(ctx.record.keys()))
        raise MonitorError(
            f"{owner} monitors {key!r}, which is not in the metric record of step "
            f"{ctx.step} (keys: {keys})"
        )
    value = ctx.record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MonitorError(f"{owner} monitors {key!r}, whose value {value!r} is not a number")
    return float(value)


def improves(value: float, best: float, mode: Mode, min_delta: float = 0.0) -> bool:
    """True when finite ``value`` beats ``best`` by more than ``min_delta`` in ``mode``."""
    if not math.isfinite(value):
        return False
    if mode == "min":
        return value < best - min_delta
    return value > best + min_delta
