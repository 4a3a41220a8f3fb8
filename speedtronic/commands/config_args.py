"""Reading a run's config from the command line, for every command that takes one:
``--config``, ``--set``, ``--output-dir``, ``--device`` (``add_config_args``) and
``--max-time`` (``add_max_time``); ``load`` reads the config with those overrides and
``loaded_config`` also checks its device on this machine."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from speedtronic.commands import UserError

if TYPE_CHECKING:
    from speedtronic.config import SpeedtronicConfig

__all__ = ["add_config_args", "add_max_time", "load", "loaded_config"]


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML or JSON config file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set optimizer.lr=1e-3 (repeatable)",
    )
    parser.add_argument("--output-dir", help="run directory (overrides run.output_dir)")
    parser.add_argument("--device", help="auto, cpu, cuda, cuda:N or mps")


def add_max_time(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-time",
        metavar="DURATION",
        help="wall-clock budget (overrides run.max_time): stop after the step during which "
        "it runs out, save, exit 75 for requeue; e.g. 3h50m, 45m, 90s, 1d2h, 03:50:00",
    )


def load(args: argparse.Namespace) -> object:
    """The config of ``--config`` with the ``--set`` overrides, and ``--output-dir``."""
    from speedtronic.config import load_config

    path = Path(args.config)
    if not path.is_file():
        raise UserError(f"config file not found: {path}")
    extra = [f"run.output_dir={json.dumps(args.output_dir)}"] if args.output_dir else []
    extra += _max_time_override(args)
    return load_config(path, overrides=[*args.overrides, *extra])


def _max_time_override(args: argparse.Namespace) -> list[str]:
    """``--max-time`` as the ``run.max_time`` override; exit 2 when it is not a duration."""
    value = getattr(args, "max_time", None)
    if value is None:
        return []
    from speedtronic.state.time_budget import MIN_TIME_BUDGET_S, DurationError, parse_duration

    try:
        seconds = parse_duration(value)
    except DurationError as exc:
        raise UserError(f"--max-time {exc}") from None
    if seconds < MIN_TIME_BUDGET_S:
        raise UserError(
            f"--max-time {value!r} is shorter than one second: a time budget must leave room "
            "for at least one step"
        )
    return [f"run.max_time={json.dumps(value)}"]


def loaded_config(args: argparse.Namespace) -> SpeedtronicConfig:
    """The config, and its device usable on this machine (exit 2 otherwise)."""
    from speedtronic.config import SpeedtronicConfig
    from speedtronic.config.preflight import device_error

    config = load(args)
    assert isinstance(config, SpeedtronicConfig)
    problem = device_error(args.device or config.run.device)
    if problem is not None:
        raise UserError(problem)
    return config
