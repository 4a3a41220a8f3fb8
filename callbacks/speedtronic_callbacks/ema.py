"""``ema``: an exponential moving average of the weights, kept on the device.

    callbacks:
      - {name: ema, decay: 0.999}            # every_steps: 1, start_step: 0

The callback keeps a *shadow* copy of every trainable parameter. After the optimizer update
of every ``every_steps``-th step (``after_optimizer_step``) the shadow moves toward the
weights::

    shadow = decay * shadow + (1 - decay) * weight      # torch._foreach_lerp_, one call

The update is a fused ``foreach`` kernel on the parameters' device; nothing is read back to
the host, so on a GPU it is queued behind the step like the optimizer's own kernels. A step
the fp16 grad scaler skipped (``ctx.skipped``: an overflow, the step is retried) does not
update the shadow. Until ``start_step`` the shadow *is* the weights: it is set to them at
step ``start_step`` (at setup when ``start_step`` is 0) and averages from there.

What the shadow is used for:

* **checkpoints** -- ``state_dict()`` holds the shadow under ``"weights"`` (parameter name
  -> tensor), the entry ``speedtronic.state.published_weights`` reads, so ``speedtronic
  export --weights ema`` and ``speedtronic evaluate --weights ema`` use it; a resumed run
  continues the same average, bit for bit;
* **evaluation** -- on every evaluation step (``eval_end``) the shadow is copied into the
  model, evaluated on the held-out set through ``trainer.evaluate()`` and the weights are
  copied back (bitwise); ``eval/ema/loss`` and ``eval/ema/ppl`` join the step's record next
  to ``eval/loss`` (``evaluate: false`` turns that off). Before ``start_step`` they are the
  model's own numbers (no second pass).

Sharded parameters (``parallel.strategy: fsdp``): each shadow tensor is a copy of the
parameter's ``DTensor`` -- this rank's shard only -- and the update runs on the local
shards. The checkpoint stores the shards through DCP with the model's
(``speedtronic.state.callback_shards``), so a sharded run's average resumes on any number of
ranks and exports whole. The shadow has each parameter's dtype.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import torch

from speedtronic.config.declare import Opt, plugin
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import (
    EvalEndContext,
    FitContext,
    MetricsContext,
    OptimizerStepContext,
)
from speedtronic.engine.evaluation import EVAL_LOSS, EVAL_PPL
from speedtronic.engine.events import Event
from speedtronic.engine.filters import StepFilter, every, logging_steps, once
from speedtronic.state.model_fit import weights_mismatch
from speedtronic.state.published_weights import WEIGHTS_ENTRY
from speedtronic.state.training_state import TrainingStateError

if TYPE_CHECKING:
    from speedtronic.engine.view import TrainerView

__all__ = ["EMA", "EMA_EVAL_LOSS", "EMA_EVAL_PPL"]

EMA_EVAL_LOSS = "eval/ema/loss"
EMA_EVAL_PPL = "eval/ema/ppl"
_EMA_KEYS = {EVAL_LOSS: EMA_EVAL_LOSS, EVAL_PPL: EMA_EVAL_PPL}


def _ema_key(key: str) -> str:
    """The record key of the shadow's evaluation metric ``key`` (``eval/loss`` ->
    ``eval/ema/loss``)."""
    return _EMA_KEYS.get(key) or key.replace("eval/", "eval/ema/", 1)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor the update writes: a ``DTensor``'s local shard (sharing its storage), or
    the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _like(saved: torch.Tensor, parameter: torch.Tensor) -> torch.Tensor:
    """A loaded shadow tensor laid out, placed and typed as ``parameter``: a whole tensor
    for a sharded parameter is cut into this rank's shard locally (no communication), a
    sharded one for a whole parameter is gathered."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(parameter, DTensor) and not isinstance(saved, DTensor):
        whole = saved.detach().to(device=parameter.device, dtype=parameter.dtype)
        return distribute_tensor(
            whole, parameter.device_mesh, parameter.placements, src_data_rank=None
        )
    if isinstance(saved, DTensor) and not isinstance(parameter, DTensor):
        saved = saved.full_tensor()
    return saved.detach().to(device=parameter.device, dtype=parameter.dtype, copy=True)


@dataclass(frozen=True)
class EMAOptions:
    """The ``ema`` plugin's options."""

    decay: Annotated[
        float,
        Opt(
            "weight of the old average in each update; in (0, 1), both ends excluded",
            exclusive_minimum=0,
            exclusive_maximum=1,
        ),
    ] = 0.999
    every_steps: Annotated[
        int, Opt("update the average every N steps", minimum=1, maximum=1_000_000_000)
    ] = 1
    start_step: Annotated[
        int,
        Opt(
            "until this step the average *is* the weights: the shadow takes them at step "
            "`start_step` (at setup when 0) and averages from there",
            minimum=0,
            maximum=1_000_000_000,
        ),
    ] = 0
    evaluate: Annotated[
        bool,
        Opt("evaluate the average too (`eval/ema/loss`, `eval/ema/ppl`) when the run evaluates"),
    ] = True


@plugin("ema", options=EMAOptions)
class EMA(Callback):
    """Keeps, checkpoints and evaluates an exponential moving average of the weights."""

    state_key: str | None = "ema"

    def __init__(
        self,
        decay: float = EMAOptions.decay,
        *,
        every_steps: int = EMAOptions.every_steps,
        start_step: int = EMAOptions.start_step,
        evaluate: bool = EMAOptions.evaluate,
    ) -> None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay < 1:
            raise ValueError(f"ema: decay must be in (0, 1) (exclusive), got {decay!r}")
        if isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 1:
            raise ValueError(f"ema: every_steps must be a positive integer, got {every_steps!r}")
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"ema: start_step must be an integer >= 0, got {start_step!r}")
        self.decay = float(decay)
        self.every_steps = every_steps
        self.start_step = start_step
        self.evaluate = evaluate
        self.live = False
        """Whether the shadow holds the average (``False`` until ``start_step``: the
        weights themselves stand for it)."""
        self.updates = 0
        """Averaging updates applied so far (all fits, resumed included)."""
        self.shadow: dict[str, torch.Tensor] = {}
        """The average, by parameter name (on the parameters' device; shards under FSDP)."""
        self._parameters: dict[str, torch.Tensor] = {}
        self._shadow_local: list[torch.Tensor] = []
        self._weights_local: list[torch.Tensor] = []
        self._loaded: Mapping[str, torch.Tensor] | None = None
        self._eval_metrics: dict[str, float] | None = None
        due: dict[Event, StepFilter] = {Event.METRICS: logging_steps()}  # evaluation steps
        if every_steps > 1 or start_step > 1:
            # start_step itself too: the shadow takes the weights there. (Due on every step,
            # the hook goes unfiltered: a filter due each step costs the plan a table a step.)
            updates = every(every_steps)
            due[Event.AFTER_OPTIMIZER_STEP] = updates | once(start_step) if start_step else updates
        self.due_when = due

    # -- state --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, object]:
        if not self.live and self._parameters:
            self._copy_weights()  # the weights stand for the average until start_step
        return {WEIGHTS_ENTRY: dict(self.shadow), "live": self.live, "updates": self.updates}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        weights = state.get(WEIGHTS_ENTRY)
        if not isinstance(weights, Mapping) or not all(
            isinstance(value, torch.Tensor) for value in weights.values()
        ):
            raise TrainingStateError(
                f"the checkpoint's ema state has no {WEIGHTS_ENTRY!r} mapping of tensors"
            )
        self._loaded = {str(name): value for name, value in weights.items()}
        self.live = bool(state.get("live", True))
        updates = state.get("updates")
        self.updates = updates if isinstance(updates, int) else 0
        if self._parameters:  # loaded between fits: take it now
            self._adopt(self._loaded)

    # -- hooks --------------------------------------------------------------------------

    def on_setup(self, trainer: TrainerView, ctx: FitContext) -> None:
        self._parameters = {
            name: parameter
            for name, parameter in trainer.model.named_parameters()
            if parameter.requires_grad
        }
        if self._loaded is not None:
            self._adopt(self._loaded)
        elif set(self.shadow) != set(self._parameters):  # a fresh start (or another model)
            with torch.no_grad():
                self.shadow = {
                    name: parameter.detach().clone() for name, parameter in self._parameters.items()
                }
            self.live = ctx.start_step >= self.start_step
        self._bind()

    def _adopt(self, loaded: Mapping[str, torch.Tensor]) -> None:
        """Make the loaded shadow this run's, checked against the parameters."""
        problem = weights_mismatch(self._parameters, loaded)
        if problem is not None:
            raise TrainingStateError(
                f"the checkpoint's ema weights do not fit the model's trainable parameters: "
                f"{problem}"
            )
        with torch.no_grad():
            self.shadow = {
                name: _like(loaded[name], parameter) for name, parameter in self._parameters.items()
            }
        self._loaded = None
        self._bind()

    def _bind(self) -> None:
        """The local tensors the update reads and writes, in one order."""
        names = list(self._parameters)
        self._shadow_local = [_local(self.shadow[name]) for name in names]
        self._weights_local = [_local(self._parameters[name].detach()) for name in names]

    def on_after_optimizer_step(self, trainer: TrainerView, ctx: OptimizerStepContext) -> None:
        step = ctx.step
        if ctx.skipped or step < self.start_step:
            return  # no update was applied / the weights stand for the average
        if step == self.start_step or not self.live:
            self._copy_weights()
            self.live = True
            return
        with torch.no_grad():
            torch._foreach_lerp_(self._shadow_local, self._weights_local, 1.0 - self.decay)
        self.updates += 1

    def _copy_weights(self) -> None:
        with torch.no_grad():
            torch._foreach_copy_(self._shadow_local, self._weights_local)

    def on_eval_end(self, trainer: TrainerView, ctx: EvalEndContext) -> None:
        if not self.evaluate:
            return
        if not self.live:  # the average is the weights: their numbers are its numbers
            self._eval_metrics = {_ema_key(key): value for key, value in ctx.metrics.items()}
            return
        with self._shadow_in_model():
            metrics = trainer.evaluate()
        self._eval_metrics = {_ema_key(key): value for key, value in metrics.items()}

    @contextmanager
    def _shadow_in_model(self) -> Iterator[None]:
        """The shadow copied into the parameters (their storage, so a sharded model
        gathers it too), and the weights copied back afterwards, bitwise."""
        with torch.no_grad():
            saved = [weight.clone() for weight in self._weights_local]
            torch._foreach_copy_(self._weights_local, self._shadow_local)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self._weights_local, saved)

    def on_metrics(self, trainer: TrainerView, ctx: MetricsContext) -> None:
        metrics, self._eval_metrics = self._eval_metrics, None
        if metrics is not None and ctx.evaluated:
            for key, value in metrics.items():
                ctx.record.set(key, value)
