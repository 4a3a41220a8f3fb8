"""A run's ``TrainerSettings`` from its config: every setting not given explicitly comes from
the config's sections, else from its default.

The runtime builds its Trainer's settings here (it gives the device, the precision and the
output directory it resolved); so does 2.0's ``Trainer(config=...)``
(``speedtronic.compat.trainer``), whose explicit keywords win over the config's values.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from speedtronic.config import SpeedtronicConfig
from speedtronic.engine.keywords import parallel_fields
from speedtronic.engine.settings import TrainerSettings
from speedtronic.systems.distributed import DistributedContext
from speedtronic.systems.precision import PrecisionPlan, resolve_device, resolve_precision

__all__ = ["configured_settings"]


def _pick(explicit: int | bool | None, configured: int | bool | None, default: int) -> int:
    if explicit is not None:
        return int(explicit)
    if configured is not None:
        return int(configured)
    return default


def configured_settings(
    config: SpeedtronicConfig,
    *,
    device: str | torch.device | None = None,
    precision: PrecisionPlan | None = None,
    accumulation_steps: int | None = None,
    grad_clip: float | None = None,
    metrics_every: int | None = None,
    allow_optimizer_reset: bool | None = None,
    output_dir: str | Path | None = None,
    compile: bool | None = None,
    distributed: DistributedContext | None = None,
    max_epochs: int | None = None,
    parallel: Mapping[str, object] | object | None = None,
) -> TrainerSettings:
    """Every argument left out from ``config`` (explicit > config > default)."""
    cfg = config
    if grad_clip is None:
        grad_clip = cfg.optimizer.grad_clip
    if device is None:  # a distributed run uses the device of this rank
        device = distributed.device if distributed else cfg.run.device
    resolved_device = resolve_device(device)
    strategy, reshard_after_forward, tensor = parallel_fields(
        cfg.parallel if parallel is None else parallel
    )
    return TrainerSettings(
        device=resolved_device,
        precision=precision or resolve_precision(cfg.precision, resolved_device),
        accumulation_steps=_pick(accumulation_steps, cfg.accumulation_steps, 1),
        auto_micro_batch=cfg.data.micro_batch_size == "auto",
        grad_clip=grad_clip,
        metrics_every=_pick(metrics_every, cfg.logging.every_steps, 1),
        # ``distributed.reset_inner_optimizer``: 2.0's DiLoCo key, still honoured here (the
        # plugin's own option is ``reset_optimizer``).
        allow_optimizer_reset=bool(
            _pick(allow_optimizer_reset, cfg.distributed.reset_inner_optimizer is not False, 1)
        ),
        compile=bool(_pick(compile, cfg.compile, 0)),
        max_epochs=max_epochs if max_epochs is not None else cfg.run.max_epochs,
        parallel=strategy,
        reshard_after_forward=reshard_after_forward,
        tensor=tensor,
        output_dir=Path(output_dir if output_dir is not None else cfg.run.output_dir),
    )
