"""``spike_guard``: skip the optimizer step of a batch whose loss (or gradient norm) spikes.

    callbacks:
      - {name: spike_guard, threshold: 6.0, warmup_steps: 50, max_skips: 5}

At ``before_optimizer_step`` -- gradients complete and unscaled, the update not yet applied --
the guard compares the step's loss (the loop's own, from the event's context; ``watch: grad_norm``:
the total gradient norm, the clipping norm when there is one; ``both``: either) with the mean
and standard deviation of the last ``window`` accepted steps. A value more than ``threshold``
standard deviations *above* the mean, or one that is not finite, is a spike -- once at least
``warmup_steps`` accepted steps make up the history (before that the guard only learns).

What a skipped step does, exactly:

* the weights and the optimizer's state are left as they were, bit for bit: the gradients
  are dropped (``trainer.skip_update``), so the optimizer step that follows is a no-op for
  every parameter (no moment update, no step count, no weight decay);
* the step still counts: the scheduler advances, the batch is consumed (the data position
  moves on, as after any step), ``trainer.step`` grows, the checkpoint may be due;
* the spiking value does not enter the history, so one spike does not widen the band;
* a warning names the step, the value, the band and the batches (the data position after
  the step's ``accumulation_steps`` microbatches); the last 100 skips are kept in the
  callback's checkpointed state (``skipped``) and the count is added to due metric records
  as ``spike_guard/skipped_steps``.

More than ``max_skips`` skipped steps within the last ``skip_window`` steps stop the fit
cleanly after the step (``fit_end`` runs; the checkpoint callback saves the last good
weights) with a stop reason the CLI turns into exit status 2: data or a learning rate that
keeps the loss spiking is the user's to fix, not something to train through.

Cost: each step's check brings one or two numbers to the host -- one device sync per step,
which the guard cannot avoid: whether the update is applied must be known on the host
before the optimizer step (nothing on the CPU; on a GPU the overlap of one step). It is the
guard's only hook on the hot path; watching the loss on one rank it reads the loss tensor
once, compares it with the band's mean (the deviation only for values above it) and updates
running sums, with no per-step allocation beyond the float (figures in docs/performance.md).
With several ranks the numbers are averaged over the world first (one all-reduce of two
floats), so every rank skips alike.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal

import torch
import torch.distributed as dist

from speedtronic.config.declare import Opt, plugin
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import (
    FitContext,
    MetricsContext,
    OptimizerStepContext,
)
from speedtronic.engine.events import Event
from speedtronic.engine.filters import logging_steps
from speedtronic.state.signals import bad_input_stop_reason
from speedtronic.user_warnings import warn
from speedtronic_callbacks.nan_guard import total_grad_norm

if TYPE_CHECKING:
    from speedtronic.engine.view import TrainerView

Watch = Literal["loss", "grad_norm", "both"]
SKIPPED_KEY = "spike_guard/skipped_steps"
_KEPT_SKIPS = 100  # skipped steps remembered in the checkpointed state


@dataclass(frozen=True)
class SpikeGuardOptions:
    """The ``spike_guard`` plugin's options."""

    watch: Annotated[
        Watch,
        Opt(
            "what spikes: the step's `loss`, the gradient norm (`grad_norm`, the clipping norm "
            "when there is one), or `both` (either one spiking skips)"
        ),
    ] = "loss"
    threshold: Annotated[
        float,
        Opt("a spike is more than this many standard deviations above the mean", minimum=0.5),
    ] = 6.0
    window: Annotated[
        int, Opt("the mean and deviation are over the last N accepted steps", minimum=2)
    ] = 200
    warmup_steps: Annotated[
        int, Opt("accepted steps of history before the guard may skip", minimum=2)
    ] = 50
    max_skips: Annotated[
        int,
        Opt("more skipped steps than this within `skip_window` stop the run (exit 2)", minimum=0),
    ] = 5
    skip_window: Annotated[
        int, Opt("the span, in steps, that `max_skips` counts over", minimum=1)
    ] = 100


@dataclass(frozen=True)
class _SkippedStep:
    """One skipped step: what spiked, and which batches (the data position after them)."""

    step: int
    watched: str
    value: float
    mean: float
    std: float
    data_position: Mapping[str, int]

    def as_dict(self) -> dict[str, object]:
        return {
            "step": self.step,
            "watched": self.watched,
            "value": self.value,
            "mean": self.mean,
            "std": self.std,
            "data_position": dict(self.data_position),
        }


class RunningBand:
    """Mean and standard deviation of the last ``window`` accepted values, in constant time
    per value: running sums, recomputed exactly once per ``window`` values so that rounding
    never accumulates. An append allocates nothing beyond the float itself (the deque's
    ring buffer is preallocated in blocks; the count is kept, not measured)."""

    # Slots: an append reads and writes five attributes, each a slot access instead of a
    # dictionary lookup (the guard runs every step).
    __slots__ = ("values", "window", "count", "_sum", "_squares", "_since_exact")

    def __init__(self, window: int) -> None:
        self.values: deque[float] = deque(maxlen=window)
        self.window = window
        self.count = 0
        self._sum = 0.0
        self._squares = 0.0
        self._since_exact = 0

    def __len__(self) -> int:
        return self.count

    def append(self, value: float) -> None:
        values = self.values
        count = self.count
        if count == self.window:
            oldest = values[0]
            self._sum += value - oldest
            self._squares += value * value - oldest * oldest
        else:
            self.count = count = count + 1
            self._sum += value
            self._squares += value * value
        values.append(value)
        since_exact = self._since_exact + 1
        if since_exact >= count:
            self.recompute()
        else:
            self._since_exact = since_exact

    def extend(self, values: Iterable[float]) -> None:
        self.values.clear()
        self.values.extend(values)
        self.count = len(self.values)
        self.recompute()

    def sums(self) -> list[float]:
        """The running sums as they stand (checkpointed: a resumed band decides exactly as
        the uninterrupted one, rounding included)."""
        return [self._sum, self._squares, float(self._since_exact)]

    def restore_sums(self, sums: Sequence[object]) -> None:
        numbers = [float(value) for value in sums if isinstance(value, int | float)]
        if len(numbers) == len(sums) == 3:
            self._sum, self._squares, since_exact = numbers
            self._since_exact = int(since_exact)

    def recompute(self) -> None:
        self._sum = math.fsum(self.values)
        self._squares = math.fsum(value * value for value in self.values)
        self._since_exact = 0

    def mean_std(self) -> tuple[float, float]:
        count = self.count
        mean = self._sum / count
        variance = max(self._squares - count * mean * mean, 0.0) / max(count - 1, 1)
        return mean, math.sqrt(variance)

    def below_mean(self, value: float) -> bool:
        """Whether ``value`` is finite and at most the mean: it cannot spike, and the
        deviation need not be computed (about half of the steps of a steady run)."""
        return self._sum / self.count >= value > -math.inf

    def spikes(self, value: float, threshold: float) -> tuple[bool, float, float]:
        """Whether ``value`` lies more than ``threshold`` deviations above the mean (a
        non-finite value always does), with the band's mean and deviation."""
        mean, std = self.mean_std()
        if not math.isfinite(value):
            return True, mean, std
        # A flat history (std 0) still tolerates relative noise of one part in a million.
        scale = max(std, 1e-6 * max(abs(mean), 1e-12))
        return (value - mean) / scale > threshold, mean, std


@plugin("spike_guard", options=SpikeGuardOptions)
class SpikeGuard(Callback):
    """Skips the update of a step whose loss or gradient norm spikes; stops the run when
    spikes keep coming."""

    state_key: str | None = "spike_guard"

    def __init__(
        self,
        watch: Watch = SpikeGuardOptions.watch,
        *,
        threshold: float = SpikeGuardOptions.threshold,
        window: int = SpikeGuardOptions.window,
        warmup_steps: int = SpikeGuardOptions.warmup_steps,
        max_skips: int = SpikeGuardOptions.max_skips,
        skip_window: int = SpikeGuardOptions.skip_window,
    ) -> None:
        if watch not in ("loss", "grad_norm", "both"):
            raise ValueError(f"watch must be 'loss', 'grad_norm' or 'both', got {watch!r}")
        if warmup_steps > window:
            raise ValueError(
                f"warmup_steps ({warmup_steps}) must not exceed window ({window}): the "
                "history never holds more than `window` steps"
            )
        self.watch: Watch = watch
        self.threshold = threshold
        self.warmup_steps = warmup_steps
        self.max_skips = max_skips
        self.skip_window = skip_window
        self.names = ("loss", "grad_norm") if watch == "both" else (watch,)
        self.bands = {name: RunningBand(window) for name in self.names}
        self.skipped: list[_SkippedStep] = []
        self.skipped_steps = 0
        self.multi_rank = False
        self._loss_band: RunningBand | None = None  # set when the lean path applies
        self.due_when = {Event.METRICS: logging_steps()}

    def on_setup(self, trainer: TrainerView, ctx: FitContext) -> None:
        context = trainer.distributed
        self.multi_rank = context is not None and context.world_size > 1
        lean = self.watch == "loss" and not self.multi_rank
        self._loss_band = self.bands["loss"] if lean else None

    # -- state ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, object]:
        return {
            "history": {name: list(band.values) for name, band in self.bands.items()},
            "sums": {name: band.sums() for name, band in self.bands.items()},
            "skipped_steps": self.skipped_steps,
            "skipped": [skip.as_dict() for skip in self.skipped],
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        history = state.get("history")
        if isinstance(history, Mapping):
            for name, band in self.bands.items():
                values = history.get(name)
                if isinstance(values, list):
                    band.extend(float(value) for value in values)
        sums = state.get("sums")
        if isinstance(sums, Mapping):
            for name, band in self.bands.items():
                saved = sums.get(name)
                if isinstance(saved, list):
                    band.restore_sums(saved)
        count = state.get("skipped_steps")
        if isinstance(count, int):
            self.skipped_steps = count
        skipped = state.get("skipped")
        if isinstance(skipped, list):
            self.skipped = [_skipped_from(entry) for entry in skipped if isinstance(entry, Mapping)]

    # -- hooks ----------------------------------------------------------------------------

    def on_before_optimizer_step(self, trainer: TrainerView, ctx: OptimizerStepContext) -> None:
        band = self._loss_band
        if band is not None:  # the common case -- the loss, one rank -- kept lean
            loss = ctx.loss
            if loss is None:
                return
            value = loss.item()  # the one host read (the decision precedes the update)
            if band.count >= self.warmup_steps and not band.below_mean(value):
                spiked, mean, std = band.spikes(value, self.threshold)
                if spiked:
                    position = dict(trainer.data_position())
                    self._skip(trainer, _SkippedStep(ctx.step, "loss", value, mean, std, position))
                    return
            band.append(value)
            return
        values = self._watched_values(trainer, ctx)
        if values is None:
            return
        for name, value in zip(self.names, values, strict=True):
            band = self.bands[name]
            if len(band) < self.warmup_steps:
                continue
            spiked, mean, std = band.spikes(value, self.threshold)
            if spiked:
                position = dict(trainer.data_position())
                self._skip(trainer, _SkippedStep(ctx.step, name, value, mean, std, position))
                return
        for name, value in zip(self.names, values, strict=True):
            self.bands[name].append(value)

    def _watched_values(
        self, trainer: TrainerView, ctx: OptimizerStepContext
    ) -> list[float] | None:
        """This step's watched numbers on the host, in ``names`` order (one transfer;
        averaged over the ranks)."""
        loss = ctx.loss
        watched: list[torch.Tensor] = []
        if self.watch != "grad_norm":
            if loss is None:
                return None
            watched.append(loss.detach().float().reshape(()))
        if self.watch != "loss":
            norm = ctx.grad_norm
            if norm is None:
                norm = total_grad_norm(trainer.trainable_parameters)
            if norm is None:
                return None
            watched.append(norm.detach().float().reshape(()).to(trainer.device))
        numbers = torch.stack([value.to(watched[0].device) for value in watched])
        context = trainer.distributed
        if context is not None and context.world_size > 1:
            numbers = numbers.to(context.collective_device)
            dist.all_reduce(numbers, op=dist.ReduceOp.SUM)
            numbers /= context.world_size
        return [float(value) for value in numbers.cpu().tolist()]  # the step's one sync

    def _skip(self, trainer: TrainerView, skip: _SkippedStep) -> None:
        trainer.skip_update()  # the optimizer step that follows changes nothing
        self.skipped_steps += 1
        self.skipped = [*self.skipped, skip][-_KEPT_SKIPS:]
        where = ", ".join(f"{key} {value}" for key, value in skip.data_position.items())
        history = len(self.bands[skip.watched])
        message = (
            f"spike_guard: step {skip.step}: {skip.watched} {skip.value:.6g} is over "
            f"{self.threshold:g} deviations above the mean of the last {history} "
            f"steps ({skip.mean:.6g} ± {skip.std:.3g}); update skipped (batches up to data "
            f"position {where or 'unknown'})"
        )
        recent = [s for s in self.skipped if s.step > skip.step - self.skip_window]
        if len(recent) > self.max_skips:
            reason = bad_input_stop_reason(
                f"spike_guard: {len(recent)} steps skipped within the last {self.skip_window} "
                f"(max_skips {self.max_skips}), the last at step {skip.step}: the data or the "
                "learning rate keeps the "
                f"{skip.watched} spiking; the weights are those before the spikes"
            )
            warn(message, RuntimeWarning)
            trainer.request_stop(reason)
            return
        warn(message, RuntimeWarning)

    def on_metrics(self, trainer: TrainerView, ctx: MetricsContext) -> None:
        ctx.record.set(SKIPPED_KEY, self.skipped_steps)


def _skipped_from(entry: Mapping[str, object]) -> _SkippedStep:
    position = entry.get("data_position")
    return _SkippedStep(
        step=int(str(entry.get("step", 0))),
        watched=str(entry.get("watched", "")),
        value=float(str(entry.get("value", "nan"))),
        mean=float(str(entry.get("mean", "nan"))),
        std=float(str(entry.get("std", "nan"))),
        data_position={
            str(key): int(value)
            for key, value in (position.items() if isinstance(position, Mapping) else ())
            if isinstance(value, int)
        },
    )
