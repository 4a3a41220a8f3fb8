"""``early_stopping``: stop the fit when a monitored metric stops improving.

    callbacks:
      - {name: early_stopping, monitor: loss, mode: min, patience: 5, min_delta: 0.001}

The metric is read from each *due* metric record (after every contributor ran, so a key
added by another callback can be monitored); ``patience`` counts due records, not steps.
An evaluation metric (``monitor: eval/loss``) is read from the records of evaluation steps
only, so ``patience`` then counts evaluations; monitoring one while evaluation is off is an
error before the first step.
An improvement is a value better than the best so far by more than ``min_delta``. After
``patience`` records without one, the callback calls ``trainer.request_stop(...)``: the
current step completes, ``fit_end`` runs (the checkpoint callback writes its final save,
sinks write their summaries), and ``TrainResult.stop_reason`` says why.

A non-finite value (NaN/Inf) stops at once when ``stop_on_non_finite`` is set (default).
A monitored key that is missing from a due record is an error naming the keys present.
The best value and the count of records without improvement are checkpointed
(``state_key: early_stopping``), so a resumed fit keeps its patience.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal

from speedtronic.config.declare import Opt, plugin
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import FitContext, MetricsContext
from speedtronic.engine.filters import METRICS_ON_LOGGING_STEPS
from speedtronic_callbacks.monitor import Mode, MonitorError, check_monitor, read_monitored

if TYPE_CHECKING:
    from speedtronic.engine.view import TrainerView

__all__ = ["EarlyStopping", "Mode", "MonitorError"]


@dataclass(frozen=True)
class EarlyStoppingOptions:
    """The ``early_stopping`` plugin's options."""

    monitor: Annotated[str, Opt("the metric record key to watch", min_length=1)] = "loss"
    mode: Annotated[Mode, Opt("whether lower (`min`) or higher (`max`) is better")] = "min"
    patience: Annotated[int, Opt("due records without improvement before stopping", minimum=1)] = 3
    min_delta: Annotated[
        float, Opt("an improvement must beat the best by more than this", minimum=0)
    ] = 0.0
    stop_on_non_finite: Annotated[bool, Opt("stop at once when the value is NaN/Inf")] = True


@plugin("early_stopping", options=EarlyStoppingOptions)
class EarlyStopping(Callback):
    """Requests a clean stop after ``patience`` due records without improvement."""

    state_key: str | None = "early_stopping"
    # Reads the finished record, like a sink; but a missing key is a real error.
    metrics_phase: ClassVar[Literal["contribute", "consume"]] = "consume"
    due_when = METRICS_ON_LOGGING_STEPS  # on_metrics only on logging steps

    def __init__(
        self,
        monitor: str = EarlyStoppingOptions.monitor,
        *,
        mode: Mode = EarlyStoppingOptions.mode,
        patience: int = EarlyStoppingOptions.patience,
        min_delta: float = EarlyStoppingOptions.min_delta,
        stop_on_non_finite: bool = EarlyStoppingOptions.stop_on_non_finite,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        if min_delta < 0:
            raise ValueError(f"min_delta must be >= 0, got {min_delta}")
        self.monitor = monitor
        self.mode: Mode = mode
        self.patience = patience
        self.min_delta = float(min_delta)
        self.stop_on_non_finite = stop_on_non_finite
        self.best = math.inf if mode == "min" else -math.inf
        self.best_step: int | None = None
        self.wait = 0
        self.stopped_step: int | None = None

    # -- state --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, object]:
        state: dict[str, object] = {"best": self.best, "wait": self.wait}
        if self.best_step is not None:
            state["best_step"] = self.best_step
        return state

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        best, wait, best_step = state.get("best"), state.get("wait"), state.get("best_step")
        if isinstance(best, (int, float)):
            self.best = float(best)
        if isinstance(wait, int):
            self.wait = wait
        self.best_step = best_step if isinstance(best_step, int) else None

    # -- logic --------------------------------------------------------------------------

    def improved(self, value: float) -> bool:
        """True when ``value`` beats the best so far by more than ``min_delta``."""
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def on_fit_start(self, trainer: TrainerView, ctx: FitContext) -> None:
        check_monitor("early_stopping", self.monitor, trainer)
        self.stopped_step = None

    def on_metrics(self, trainer: TrainerView, ctx: MetricsContext) -> None:
        if self.stopped_step is not None:
            return
        value = read_monitored("early_stopping", self.monitor, ctx)
        if value is None:
            return  # an evaluation metric, and this step did not evaluate
        reason = self._update(value, ctx.step)
        if reason is not None:
            self.stopped_step = ctx.step
            trainer.request_stop(f"early_stopping: {reason}")

    def _update(self, value: float, step: int) -> str | None:
        """Record ``value``; the stop reason when the fit should stop, else ``None``."""
        if not math.isfinite(value):
            if self.stop_on_non_finite:
                return f"{self.monitor} is {value} at step {step}"
            self.wait += 1
        elif self.improved(value):
            self.best, self.best_step, self.wait = value, step, 0
            return None
        else:
            self.wait += 1
        if self.wait >= self.patience:
            best_at = f" at step {self.best_step}" if self.best_step is not None else ""
            return (
                f"{self.monitor} did not improve for {self.wait} checks "
                f"(best {self.best:.6g}{best_at}, mode {self.mode}, min_delta {self.min_delta:g})"
            )
        return None
