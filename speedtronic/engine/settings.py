"""``TrainerSettings``: how a Trainer runs, every value resolved; ``RunConfigSource``: the
run's config as the Trainer holds it.

The Trainer runs on one of these and never reads a config: whatever fills the values in --
its keywords (``speedtronic.engine.keywords``), a config's sections
(``speedtronic.composition.trainer_settings``) -- resolves them first. The defaults are those
of a ``Trainer`` built in Python with no settings at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import torch

from speedtronic.systems.precision import PrecisionPlan

__all__ = ["ParallelStrategy", "RunConfigSource", "TrainerSettings"]

ParallelStrategy = Literal["ddp", "fsdp"]


class RunConfigSource(Protocol):
    """A run's config as ``Trainer.config`` holds it (a ``SpeedtronicConfig``): what
    checkpoints record and sinks log is its plain data, secrets redacted."""

    def to_dict(self, *, redact_secrets: bool = ...) -> Mapping[str, object]: ...


@dataclass(frozen=True)
class TrainerSettings:
    """Every value the engine's Trainer runs with (see the module docstring)."""

    device: torch.device = torch.device("cpu")
    precision: PrecisionPlan | None = None
    """``None``: the device's ``auto`` plan (``resolve_precision``; fp32 on the CPU)."""
    accumulation_steps: int = 1
    """Microbatches per global step (K)."""
    auto_micro_batch: bool = False
    """``data.micro_batch_size: auto``: shrink the micro-batch on running out of memory
    (``speedtronic.engine.oom_retry``)."""
    grad_clip: float | None = None
    """Clip the gradients' total norm to this before each optimizer step."""
    metrics_every: int = 1
    """Logging steps: every this many steps (and the final step, and evaluation steps)."""
    allow_optimizer_reset: bool = True
    """Honour a callback's request to reset the optimizer state (``optimizer_reset``)."""
    compile: bool = False
    """``torch.compile`` the forward path (eager when the compiler fails)."""
    max_epochs: int | None = None
    """End the fit when the data stream would start this epoch (``None``: no limit)."""
    parallel: ParallelStrategy = "ddp"
    """``parallel.strategy``: data-parallel replicas, or FSDP2 shards."""
    reshard_after_forward: bool = True
    """FSDP: free the gathered parameters after each block's forward."""
    tensor: int = 1
    """FSDP: the tensor-parallel degree (ranks splitting each layer; 1: none)."""
    output_dir: Path = Path("runs")
    """The run's output directory (relative plugin paths live under it)."""

    def __post_init__(self) -> None:
        if self.accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {self.accumulation_steps}")
        epochs = self.max_epochs
        if epochs is not None and (
            isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1
        ):
            raise ValueError(f"max_epochs must be a positive integer, got {epochs!r}")
