"""The learning-rate schedule: linear warmup, then constant or cosine decay to a floor."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from speedtronic.optimizers.settings import SchedulerSettings

__all__ = ["SCHEDULES", "build_scheduler", "lr_multiplier"]

SCHEDULES = ("cosine", "constant")


def lr_multiplier(
    step: int, *, schedule: str, warmup_steps: int, max_steps: int, min_lr_ratio: float
) -> float:
    """The factor applied to each group's base lr at scheduler step ``step`` (0-based).

    Linear warmup ``(step + 1) / warmup_steps``, then ``constant`` (1.0) or ``cosine`` from 1
    down to ``min_lr_ratio`` over ``max_steps - warmup_steps`` steps (held there after).
    """
    if warmup_steps > 0 and step < warmup_steps:
        return max(1e-8, (step + 1) / warmup_steps)
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    progress = min(1.0, max(0.0, progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _checked_schedule(settings: SchedulerSettings, max_steps: int) -> str:
    schedule = settings.name.strip().lower()
    if schedule not in SCHEDULES:
        raise ValueError(f"scheduler.name must be 'cosine' or 'constant', got {settings.name!r}")
    if settings.warmup_steps < 0 or max_steps <= 0:
        raise ValueError("scheduler warmup_steps must be >= 0 and max_steps > 0")
    if not 0.0 <= settings.min_lr_ratio <= 1.0:
        raise ValueError(f"scheduler.min_lr_ratio must be in [0, 1], got {settings.min_lr_ratio}")
    return schedule


def build_scheduler(
    optimizer: torch.optim.Optimizer, settings: SchedulerSettings, max_steps: int
) -> LambdaLR:
    """A ``LambdaLR`` over every param group (both hybrid branches) for a run whose schedule
    ends at ``max_steps`` (the caller resolves ``scheduler.max_steps`` vs ``run.max_steps``).

    The schedule is a plain function of the config, so it is not stored in the scheduler's
    state dict: on resume the step counter comes from the checkpoint and the shape from the
    (possibly edited) config.
    """
    schedule = _checked_schedule(settings, max_steps)
    warmup, floor = settings.warmup_steps, settings.min_lr_ratio

    def multiplier(step: int) -> float:
        return lr_multiplier(
            step, schedule=schedule, warmup_steps=warmup, max_steps=max_steps, min_lr_ratio=floor
        )

    return LambdaLR(optimizer, multiplier)
