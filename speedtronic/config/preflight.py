"""What can be known about a run before anything is built: problems and warnings.

Schema validation answers "is this config well formed"; these checks answer "will this run
work on this machine, and does it do what the user probably meant". ``speedtronic validate``
and ``speedtronic fit`` run them before building the model (through
``speedtronic.runtime.preflight``, which adds the checks of the run's datasets), so a missing
text file, ``device: cuda`` on a machine without CUDA or ``device: meta`` is an exit 2 at
``validate`` time, not an exit 1 halfway through ``fit``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from speedtronic.config import SpeedtronicConfig

_WARMUP_SHARE_LIMIT = 0.5
"""Warn when the LR warm-up covers more than this share of the run's steps."""


@dataclass(frozen=True)
class Preflight:
    """The outcome of the checks: ``errors`` stop the run, ``warnings`` are printed."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def device_error(device: str) -> str | None:
    """Why ``device`` cannot run here (unknown, ``meta``, not available), or ``None``."""
    import torch

    name = device.strip().lower()
    if name == "auto":
        return None
    try:
        kind = torch.device(name).type
    except (RuntimeError, ValueError) as exc:
        return f"run.device: {device!r} is not a device torch knows ({exc})"
    if kind == "meta":
        return (
            f"run.device: {device!r} holds no data (meta tensors only describe shapes): a run "
            "cannot train or evaluate on it; use auto, cpu, cuda[:N] or mps"
        )
    if kind == "cpu":
        return None
    if kind not in ("cuda", "mps"):
        backend = getattr(torch, kind, None)
        available = getattr(backend, "is_available", None)
        if not callable(available) or not available():
            return (
                f"run.device: {device!r} was asked for but {kind} is not available on this machine"
            )
        return None
    if kind == "cuda" and not torch.cuda.is_available():
        return f"run.device: {device!r} was asked for but CUDA is not available on this machine"
    if kind == "cuda" and ":" in device:
        index = int(device.split(":", 1)[1]) if device.split(":", 1)[1].isdigit() else -1
        count = torch.cuda.device_count()
        if not 0 <= index < count:
            return f"run.device: {device!r} does not exist (this machine has {count} CUDA devices)"
    if kind == "mps" and not torch.backends.mps.is_available():
        return f"run.device: {device!r} was asked for but MPS is not available on this machine"
    return None


def _file_error(key: str, path: str | None) -> str | None:
    if path is None:
        return None
    file = Path(path).expanduser()
    if not file.exists():
        return f"{key}: {path!r} does not exist"
    if not file.is_file():
        return f"{key}: {path!r} is not a file"
    return None


def _data_errors(config: SpeedtronicConfig) -> list[str]:
    """The text files the run reads: ``data.text_path``, and ``eval.text_path`` when the fit
    evaluates (``speedtronic evaluate`` reports it itself otherwise)."""
    found = [_file_error("data.text_path", config.data.text_path)]
    if config.data.tokenizer != "bytes":
        found.append(_file_error("data.tokenizer", config.data.tokenizer))
    if config.eval.every_steps is not None:
        found.append(_file_error("eval.text_path", config.eval.text_path))
    return [error for error in found if error is not None]


def _schedule_length_source(config: SpeedtronicConfig) -> str:
    """The key the LR schedule's length comes from (``SpeedtronicConfig.scheduler_steps``)."""
    if config.scheduler.max_steps is not None:
        return "scheduler.max_steps"
    return "run.max_steps" if config.data.max_steps is None else "data.max_steps"


def _warmup_warning(config: SpeedtronicConfig, max_steps: int | None) -> str | None:
    """Warn when the warm-up takes most of the LR *schedule*. The schedule's length is the
    config's (``--max-steps`` moves the stop, never the schedule -- see docs/optimizers.md),
    so that length, and only that one, decides the warning and its advice."""
    warmup = config.scheduler.warmup_steps
    horizon = config.scheduler_steps
    if horizon <= 0 or warmup <= _WARMUP_SHARE_LIMIT * horizon:
        return None
    source = _schedule_length_source(config)
    stop = (
        f"; --max-steps {max_steps} moves only where the run stops, not the schedule"
        if max_steps is not None and max_steps != horizon
        else ""
    )
    return (
        f"scheduler.warmup_steps={warmup} covers more than half of the {horizon}-step LR "
        f"schedule ({source}={horizon}{stop}): the learning rate stays low for most of it; "
        f"set scheduler.warmup_steps to about {max(1, horizon // 10)} (10% of the schedule)"
    )


def check(
    config: SpeedtronicConfig, *, device: str | None = None, max_steps: int | None = None
) -> Preflight:
    """Check ``config`` as it would run here, with the CLI's ``--device``/``--max-steps``."""
    result = Preflight()
    problem = device_error(device or config.run.device)
    if problem is not None:
        result.errors.append(problem)
    result.errors.extend(_data_errors(config))
    warmup = _warmup_warning(config, max_steps)
    if warmup is not None:
        result.warnings.append(warmup)
    return result
