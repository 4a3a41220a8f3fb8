"""The learning-rate schedule: linear warmup, then constant or cosine decay to a floor."""

from __future__ import annotations

import math
from typing import cast

import torch
from torch.optim.lr_scheduler import LambdaLR

from speedtronic.optimizers.settings import RunSettings, SchedulerSettings

__all__ = ["build_scheduler", "lr_multiplier"]

_SCHEDULES = ("cosine", "constant")


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
    if schedule not in _SCHEDULES:
        raise ValueError(f"scheduler.name must be 'cosine' or 'constant', got {settings.name!r}")
    if settings.warmup_steps < 0 or max_steps <= 0:
        raise ValueError("scheduler warmup_steps must be >= 0 and max_steps > 0")
    if not 0.0 <= settings.min_lr_ratio <= 1.0:
        raise ValueError(f"scheduler.min_lr_ratio must be in [0, 1], got {settings.min_lr_ratio}")
    return schedule


def _scheduler_settings(
    config: SchedulerSettings | RunSettings, max_steps: int | None
) -> tuple[SchedulerSettings, int]:
    """The section and the horizon from a whole config (2.0's argument: the horizon is
    ``scheduler_steps``) or from the section (the horizon is ``max_steps``, else the
    section's own ``max_steps``)."""
    section = getattr(config, "scheduler", None)
    if section is not None and not isinstance(section, str):
        whole = cast(RunSettings, config)
        return whole.scheduler, whole.scheduler_steps if max_steps is None else max_steps
    settings = cast(SchedulerSettings, config)
    if max_steps is None:
        own = getattr(settings, "max_steps", None)
        if not isinstance(own, int) or isinstance(own, bool):
            raise ValueError(
                "build_scheduler needs max_steps with a scheduler section whose max_steps is "
                "not set (pass the whole config to use the run's target)"
            )
        max_steps = own
    return settings, max_steps


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    config: SchedulerSettings | RunSettings,
    max_steps: int | None = None,
) -> LambdaLR:
    """A ``LambdaLR`` over every param group (both hybrid branches) for a run whose schedule
    ends at ``max_steps``. ``config`` is the whole config, as in 2.0 (the horizon is then
    ``scheduler.max_steps``, else the run's target), or the ``scheduler`` section (the
    caller passes the horizon, else the section's ``max_steps`` is used).

    The schedule is a plain function of the config, so it is not stored in the scheduler's
    state dict: on resume the step counter comes from the checkpoint and the shape from the
    (possibly edited) config.
    """
    settings, max_steps = _scheduler_settings(config, max_steps)
    schedule = _checked_schedule(settings, max_steps)
    warmup, floor = settings.warmup_steps, settings.min_lr_ratio

    def multiplier(step: int) -> float:
        return lr_multiplier(
            step, schedule=schedule, warmup_steps=warmup, max_steps=max_steps, min_lr_ratio=floor
        )

    return LambdaLR(optimizer, multiplier)
