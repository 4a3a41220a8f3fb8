"""``nan_guard``: catch a NaN/Inf loss or gradient before it reaches the weights.

    callbacks:
      - {name: nan_guard, action: stop}        # or raise, or skip

The check runs at ``before_optimizer_step`` -- gradients complete and unscaled, the update
not yet applied -- on every ``check_every``-th step. It looks at the step's loss (the sum
of its microbatch losses, collected at ``after_backward`` without a sync) and, with
``check_grads``, at the total gradient norm (the one clipping computed, else one fused
``foreach`` norm over all gradients). Both numbers come to the host in **one** transfer:
each check is one device sync. On CPU that costs next to nothing; on a GPU it stalls the
host until the step's backward finished, which costs the overlap of one step -- raise
``check_every`` (e.g. to the logging cadence) when that matters. With the fp16 grad scaler
the gradient check is off (the scaler already skips overflowing steps); the loss check
stays.

What happens on a non-finite step (``action``):

* ``stop`` (default): the gradients are dropped so the bad update is never applied, the
  trainer is asked to stop, and the fit ends cleanly after this step -- ``fit_end`` runs,
  the checkpoint callback saves the last good weights, sinks close. ``stop_reason`` (and a
  ``RuntimeWarning``) name the step.
* ``raise``: a ``NonFiniteLossError`` (a ``FloatingPointError``) naming the step ends the
  fit as a failure; ``teardown`` still closes every sink. No final checkpoint.
* ``skip``: the gradients are dropped (set to ``None``, so the optimizer step is a no-op:
  no weight decay, no moment update), a warning names the step, and training goes on. The
  step still counts (the scheduler advances, the batch is consumed). The running count is
  added to metric records as ``nan_guard/skipped_steps`` and checkpointed. After
  ``max_consecutive_skips`` bad steps in a row the guard stops the fit as with ``stop``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal

import torch

from speedtronic.config.declare import Opt, plugin
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import (
    BackwardContext,
    FitContext,
    MetricsContext,
    OptimizerStepContext,
)
from speedtronic.engine.events import Event
from speedtronic.engine.filters import every, logging_steps
from speedtronic.user_warnings import warn

if TYPE_CHECKING:
    from speedtronic.engine.view import TrainerView

_Action = Literal["stop", "raise", "skip"]
SKIPPED_KEY = "nan_guard/skipped_steps"


class NonFiniteLossError(FloatingPointError):
    """The loss or the gradients of a step were NaN or infinite."""


def total_grad_norm(parameters: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The L2 norm of all gradients as a 0-d tensor (``None`` when there are none)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return None
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
    if callable(get_total_norm):  # torch >= 2.6: fused foreach kernels
        norm = get_total_norm(grads, 2.0, False, None)
        assert isinstance(norm, torch.Tensor)
        return norm
    norms = torch.stack([torch.linalg.vector_norm(g) for g in grads])
    result: torch.Tensor = torch.linalg.vector_norm(norms)
    return result


def _describe_problem(loss: float, grad_norm: float | None) -> str:
    problems = []
    if not math.isfinite(loss):
        problems.append(f"loss is {loss}")
    if grad_norm is not None and not math.isfinite(grad_norm):
        problems.append(f"gradient norm is {grad_norm}")
    return " and ".join(problems)


@dataclass(frozen=True)
class NanGuardOptions:
    """The ``nan_guard`` plugin's options."""

    action: Annotated[
        _Action,
        Opt(
            "`stop`: clean stop without applying the bad update; `raise`: fail with "
            "`NonFiniteLossError`; `skip`: drop the update and go on"
        ),
    ] = "stop"
    check_every: Annotated[
        int, Opt("check every N-th step (each check is one device sync)", minimum=1)
    ] = 1
    check_grads: Annotated[
        bool,
        Opt(
            "also check the gradient norm (the clipping norm when there is one, else one "
            "fused norm)"
        ),
    ] = True
    max_consecutive_skips: Annotated[
        int, Opt("`skip`: stop after this many bad steps in a row", minimum=1)
    ] = 10


@plugin("nan_guard", options=NanGuardOptions)
class NanGuard(Callback):
    """Stops, raises, or skips the update when a step's loss or gradients are not finite."""

    state_key: str | None = "nan_guard"

    def __init__(
        self,
        action: _Action = NanGuardOptions.action,
        *,
        check_every: int = NanGuardOptions.check_every,
        check_grads: bool = NanGuardOptions.check_grads,
        max_consecutive_skips: int = NanGuardOptions.max_consecutive_skips,
    ) -> None:
        if action not in ("stop", "raise", "skip"):
            raise ValueError(f"action must be 'stop', 'raise' or 'skip', got {action!r}")
        if check_every < 1:
            raise ValueError(f"check_every must be >= 1, got {check_every}")
        if max_consecutive_skips < 1:
            raise ValueError(f"max_consecutive_skips must be >= 1, got {max_consecutive_skips}")
        self.action: _Action = action
        self.check_every = check_every
        self.check_grads = check_grads
        self.max_consecutive_skips = max_consecutive_skips
        self.skipped_steps = 0
        self.consecutive = 0
        self.last_problem: str | None = None
        self._loss_sum: torch.Tensor | None = None
        checked = every(check_every)
        self.due_when = {
            Event.AFTER_BACKWARD: checked,
            Event.BEFORE_OPTIMIZER_STEP: checked,
            Event.METRICS: logging_steps(),
        }

    def state_dict(self) -> dict[str, object]:
        return {"skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        skipped = state.get("skipped_steps")
        if isinstance(skipped, int):
            self.skipped_steps = skipped

    # -- hooks --------------------------------------------------------------------------

    def on_fit_start(self, trainer: TrainerView, ctx: FitContext) -> None:
        self.consecutive = 0
        self._loss_sum = None

    def on_after_backward(self, trainer: TrainerView, ctx: BackwardContext) -> None:
        loss = ctx.loss.detach()
        self._loss_sum = loss if ctx.index == 0 or self._loss_sum is None else self._loss_sum + loss

    def on_before_optimizer_step(self, trainer: TrainerView, ctx: OptimizerStepContext) -> None:
        loss_sum, self._loss_sum = self._loss_sum, None
        if loss_sum is None:
            return
        grad_norm = ctx.grad_norm
        if grad_norm is None and self.check_grads and not trainer.uses_grad_scaler:
            grad_norm = total_grad_norm(trainer.trainable_parameters)
        if grad_norm is not None and trainer.uses_grad_scaler:
            grad_norm = None  # overflowing fp16 grads are the scaler's business
        watched = [loss_sum.float().reshape(())]
        if grad_norm is not None:
            watched.append(grad_norm.detach().float().reshape(()).to(loss_sum.device))
        numbers = torch.stack(watched).cpu().tolist()  # the one host sync of a check
        loss_value = float(numbers[0])
        grad_value = float(numbers[1]) if len(numbers) > 1 else None
        if math.isfinite(loss_value) and (grad_value is None or math.isfinite(grad_value)):
            self.consecutive = 0
            return
        self._handle(trainer, ctx.step, _describe_problem(loss_value, grad_value))

    def _handle(self, trainer: TrainerView, step: int, problem: str) -> None:
        message = f"nan_guard: {problem} at step {step}"
        self.last_problem = message
        if self.action == "raise":
            raise NonFiniteLossError(message)
        # Without gradients the optimizer step is a no-op: the bad update never lands.
        trainer.skip_update()
        if self.action == "stop":
            self._stop(trainer, f"{message}; update not applied, stopping")
            return
        self.skipped_steps += 1
        self.consecutive += 1
        if self.consecutive >= self.max_consecutive_skips:
            self._stop(
                trainer, f"{message}; {self.consecutive} non-finite steps in a row, stopping"
            )
            return
        warn(
            f"{message}; update skipped ({self.skipped_steps} skipped so far)",
            RuntimeWarning,
        )

    @staticmethod
    def _stop(trainer: TrainerView, reason: str) -> None:
        warn(reason, RuntimeWarning)
        trainer.request_stop(reason)

    def on_metrics(self, trainer: TrainerView, ctx: MetricsContext) -> None:
        if self.action == "skip":
            ctx.record.set(SKIPPED_KEY, self.skipped_steps)
