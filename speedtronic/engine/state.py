"""The training state: one object for everything a fit changes and a checkpoint holds.

``TrainingState`` holds the parts a step works on (model, optimizer, scheduler, grad scaler,
data stream, callbacks), the counters, what callbacks requested during a step, and the facts
a checkpoint of it records (precision, run identity, the redacted config, how it is laid out
over the ranks). The per-step loop (``speedtronic.engine.loop``), evaluation
(``speedtronic.engine.evaluation``), the capture and restore of checkpoints
(``speedtronic.state.training_state``) and the view hooks receive (``TrainerView``, through
the Trainer's members of the same names) all read and write this one object; the ``Trainer``
holds it next to the parts that are not state (the callback plan, the forward path, the
settings) and runs a fit over it.

It is a plain slotted object rather than properties over several: the loop reads and writes
its members every step (``state.samples += ...``), at the cost of one attribute each.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from speedtronic.engine.callback import Callback
from speedtronic.engine.metrics import MetricValue
from speedtronic.systems.precision import PrecisionPlan

if TYPE_CHECKING:
    from speedtronic.data.stream import BatchStream
    from speedtronic.systems.distributed import DistributedContext

__all__ = ["FitClock", "LRScheduler", "TrainingState"]

LRScheduler = torch.optim.lr_scheduler.LRScheduler


@dataclass(frozen=True)
class FitClock:
    """Where a fit started, for invocation-local rates."""

    start_time: float
    start_step: int
    start_samples: int
    start_tokens: int


class _StepRequests:
    """Requests callbacks made: a stop (the first reason wins; in a multi-rank run the
    ranks agree on it, ``agreed_stop``) and optimizer resets for the current step."""

    __slots__ = ("agreed_stop", "resets", "stop_reason")

    def __init__(self) -> None:
        self.stop_reason: str | None = None
        self.agreed_stop: str | None = None
        self.resets: list[str] = []

    def begin_fit(self) -> None:
        """A new fit starts: earlier stop requests no longer apply."""
        self.stop_reason = None
        self.agreed_stop = None

    def request_stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason

    def request_reset(self, requested_by: str) -> None:
        self.resets.append(requested_by)

    def take_resets(self) -> tuple[str, ...]:
        """Who asked for a reset in this step; clears the requests."""
        requested = tuple(self.resets)
        self.resets.clear()
        return requested


@dataclass(eq=False, slots=True)
class TrainingState:
    """Everything a fit changes and a checkpoint holds (see the module docstring)."""

    # -- the parts a step works on -------------------------------------------------------
    model: nn.Module
    """The raw model (never the DDP or compiled wrapper)."""
    optimizer: torch.optim.Optimizer
    stream: BatchStream[object]
    """The training batches, re-iterated forever; its position is part of the state."""
    precision: PrecisionPlan
    device: torch.device
    scheduler: LRScheduler | None = None
    scaler: torch.amp.GradScaler | None = None
    """fp16's grad scaler (``None`` in every other precision)."""
    callbacks: list[Callback] = field(default_factory=list)
    """Every callback of the run, in order; their ``state_dict()`` is part of the state."""
    trainable_parameters: list[torch.Tensor] = field(default_factory=list)
    """The parameters the optimizer updates (``requires_grad``), in model order."""

    # -- what a checkpoint records about the run -----------------------------------------
    output_dir: Path = Path("runs")
    run_config: Mapping[str, object] | None = None
    """The run's config as plain data, secrets redacted (``None``: built without one)."""
    run_id: str | None = None
    """Which run this state continues (``speedtronic.state.run_identity``): recorded in every
    checkpoint. ``None`` records nothing and resumes any checkpoint."""
    distributed: DistributedContext | None = None
    sharded: bool = False
    """Whether the model and optimizer are FSDP shards (``parallel.strategy: fsdp``)."""
    tensor: int = 1
    """Ranks that train each batch together (``parallel.tensor``): each counts it, so the
    run's totals are the ranks' sums divided by it."""

    # -- the counters ---------------------------------------------------------------------
    step: int = 0
    """Global steps completed."""
    samples: int = 0
    tokens: int = 0
    skipped_steps: int = 0
    """Steps the fp16 grad scaler skipped (and the loop retried)."""
    step_loss: torch.Tensor | None = None
    """The last completed step's loss as the loop left it: with one microbatch still
    attached to its (already freed) graph, like a hand-written loop's ``loss``; read it
    through ``Trainer.last_loss``."""

    # -- this fit ---------------------------------------------------------------------------
    target_step: int = 0
    """The absolute step this fit trains up to."""
    fit_clock: FitClock = FitClock(0.0, 0, 0, 0)
    due_records: list[dict[str, MetricValue]] = field(default_factory=list)
    """The fit's metric records of logging steps (``TrainResult.metrics``)."""
    pending_eval: Mapping[str, float] | None = None
    """This step's evaluation results until the metric record takes them."""
    requests: _StepRequests = field(default_factory=_StepRequests)
    plain_step: bool = False
    """This fit's step needs no grad scaler, no gradient-rank bookkeeping and no context
    around the forward pass (set at fit start): with K = 1, no clipping and no hook due, the
    loop takes its lean path (``loop._lean_step``)."""
    moves_batches: bool = True
    """Batches go to another device than the CPU they come from (set at fit start: a
    ``device.type`` read costs more than the check it makes)."""

    @property
    def multi_rank(self) -> bool:
        """True in a distributed run with more than one rank."""
        return self.distributed is not None and self.distributed.world_size > 1
