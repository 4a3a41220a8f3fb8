"""What can be known about a run before anything is built: problems and warnings.

Schema validation answers "is this config well formed"; these checks answer "will this run
work on this machine, and does it do what the user probably meant". ``speedtronic validate``
and ``speedtronic fit`` run them before building the model, so a missing text file or
``device: cuda`` on a machine without CUDA is an exit 2 at ``validate`` time, not an exit 1
halfway through ``fit``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from speedtronic.config import SpeedtronicConfig

WARMUP_SHARE_LIMIT = 0.5
"""Warn when the LR warm-up covers more than this share of the run's steps."""


@dataclass(frozen=True)
class Preflight:
    """The outcome of the checks: ``errors`` stop the run, ``warnings`` are printed."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _device_error(device: str) -> str | None:
    import torch

    kind = device.split(":", 1)[0]
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


def _data_errors(config: SpeedtronicConfig) -> list[str]:
    errors = _file_errors("data.text_path", config.data.text_path)
    tokenizer = config.data.tokenizer
    if tokenizer != "bytes":
        errors.extend(_file_errors("data.tokenizer", tokenizer))
    errors.extend(_shard_errors(config))
    return errors


def _file_errors(key: str, path: str | None) -> list[str]:
    if path is None:
        return []
    file = Path(path).expanduser()
    if not file.exists():
        return [f"{key}: {path!r} does not exist"]
    if not file.is_file():
        return [f"{key}: {path!r} is not a file"]
    return []


def _shard_errors(config: SpeedtronicConfig) -> list[str]:
    """Each shard directory has a usable manifest whose vocabulary fits the model (the
    shards themselves are checked when the data is built)."""
    directories = [("data.tokens", config.data.tokens)] if config.data.tokens else []
    directories += [
        (f"data.mixture[{index}].tokens", source.tokens)
        for index, source in enumerate(config.data.mixture)
    ]
    if not directories:
        return []
    from speedtronic.data import DataSourceError
    from speedtronic.data.shards import check_vocab_fits, read_manifest

    errors = []
    for key, directory in directories:
        try:
            manifest = read_manifest(directory)
            if config.data.vocab_size is not None:
                where = f"{key}: {directory}"
                check_vocab_fits(manifest.vocab_size, config.data.vocab_size, source=where)
        except DataSourceError as exc:
            message = str(exc)
            errors.append(message if message.startswith(key) else f"{key}: {message}")
    return errors


def _warmup_warning(config: SpeedtronicConfig, target_steps: int) -> str | None:
    warmup = config.scheduler.warmup_steps
    if target_steps <= 0 or warmup <= WARMUP_SHARE_LIMIT * target_steps:
        return None
    return (
        f"scheduler.warmup_steps={warmup} covers more than half of this {target_steps}-step run "
        "(the learning rate stays low for most of it); for short runs set "
        f"scheduler.warmup_steps to about {max(1, target_steps // 10)} (10% of the steps)"
    )


def check(
    config: SpeedtronicConfig, *, device: str | None = None, max_steps: int | None = None
) -> Preflight:
    """Check ``config`` as it would run here, with the CLI's ``--device``/``--max-steps``."""
    result = Preflight()
    device_error = _device_error(device or config.run.device)
    if device_error is not None:
        result.errors.append(device_error)
    result.errors.extend(_data_errors(config))
    warmup = _warmup_warning(config, max_steps if max_steps is not None else config.target_steps)
    if warmup is not None:
        result.warnings.append(warmup)
    return result
