"""The original ``Trainer`` constructor arguments, resolved outside the engine.

The 2.0 ``Trainer`` took a ``config=`` whose sections filled every argument left out, and
``logger=``, ``checkpoint_manager=`` and ``coordinator=`` objects. Both still work: this module
turns them into what the engine needs -- plain resolved values (``TrainerSettings``) and
callbacks -- so the engine itself knows no config section and no plugin by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from speedtronic.compat.coordinator import CoordinatorCallback, SyncCoordinator
from speedtronic.compat.metric_logger import MetricLogger, MetricLoggerCallback
from speedtronic.engine.callback import Callback
from speedtronic.plugins import callback_registry
from speedtronic.systems.precision import PrecisionPlan, resolve_device, resolve_precision

if TYPE_CHECKING:
    from speedtronic.config import SpeedtronicConfig
    from speedtronic.engine.notes import Notes
    from speedtronic.state.checkpoint import CheckpointManager
    from speedtronic.systems.distributed import DistributedContext

__all__ = ["TrainerSettings", "coerce_config", "legacy_callbacks", "resolve_settings"]


@dataclass(frozen=True)
class TrainerSettings:
    """Every value the engine's Trainer runs with, resolved (explicit > config > default)."""

    device: torch.device
    precision: PrecisionPlan
    accumulation_steps: int
    grad_clip: float | None
    metrics_every: int
    allow_optimizer_reset: bool
    max_steps: int | None
    output_dir: Path
    compile: bool


def coerce_config(
    config: SpeedtronicConfig | Mapping[str, object] | None,
) -> SpeedtronicConfig | None:
    """A ``SpeedtronicConfig`` from a config object or a plain mapping (validated)."""
    if config is None:
        return None
    from speedtronic.config import SpeedtronicConfig

    if isinstance(config, SpeedtronicConfig):
        return config
    return SpeedtronicConfig.from_dict(config)


def _pick(explicit: int | bool | None, configured: int | bool | None, default: int) -> int:
    if explicit is not None:
        return int(explicit)
    if configured is not None:
        return int(configured)
    return default


def resolve_settings(
    config: SpeedtronicConfig | None,
    *,
    device: str | torch.device | None,
    precision: PrecisionPlan | None,
    accumulation_steps: int | None,
    grad_clip: float | None,
    metrics_every: int | None,
    allow_optimizer_reset: bool | None,
    max_steps: int | None,
    output_dir: str | Path | None,
    compile: bool | None,
    distributed: DistributedContext | None,
) -> TrainerSettings:
    """Fill every argument left out from ``config`` (the 2.0 behaviour), else a default."""
    cfg = config
    if grad_clip is None and cfg is not None:
        grad_clip = cfg.optimizer.grad_clip
    if device is None:  # a distributed run uses the device of this rank
        device = distributed.device if distributed else (cfg.run.device if cfg else "cpu")
    resolved_device = resolve_device(device)
    return TrainerSettings(
        device=resolved_device,
        precision=precision or resolve_precision(cfg.precision if cfg else None, resolved_device),
        accumulation_steps=_pick(accumulation_steps, cfg.accumulation_steps if cfg else None, 1),
        grad_clip=grad_clip
        if grad_clip is not None
        else (cfg.optimizer.grad_clip if cfg else None),
        metrics_every=_pick(metrics_every, cfg.logging.every_steps if cfg else None, 1),
        # 2.0's ``distributed.reset_inner_optimizer`` (a DiLoCo key, read here only for the
        # original ``Trainer(config=...)``; the plugin's own option is ``reset_optimizer``).
        allow_optimizer_reset=bool(
            _pick(
                allow_optimizer_reset,
                (cfg.distributed.reset_inner_optimizer is not False) if cfg else None,
                1,
            )
        ),
        max_steps=max_steps if max_steps is not None else (cfg.target_steps if cfg else None),
        output_dir=Path(
            output_dir if output_dir is not None else (cfg.run.output_dir if cfg else "runs")
        ),
        compile=bool(_pick(compile, cfg.compile if cfg else None, 0)),
    )


def legacy_callbacks(
    coordinator: SyncCoordinator | None,
    logger: MetricLogger | None,
    checkpoint_manager: CheckpointManager | None,
    notes: Notes | None = None,
) -> list[Callback]:
    """The original constructor arguments, adapted to callbacks (same events, same order).
    The logger listens to ``notes`` (the trainer's board) from now on, so it also gets the
    notes published before the first fit's ``setup`` (``compile``)."""
    adapted: list[Callback] = []
    if coordinator is not None:
        adapted.append(CoordinatorCallback(coordinator))
    if logger is not None:
        adapted.append(MetricLoggerCallback(logger, notes=notes))
    if checkpoint_manager is not None:
        # The checkpoint feature is a plugin: found through the registry, never imported.
        factory = cast("Callable[..., Callback]", callback_registry.get("checkpoint"))
        adapted.append(factory(manager=checkpoint_manager))
    return adapted
