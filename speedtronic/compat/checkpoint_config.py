"""2.0's ``CheckpointConfig`` dataclass, kept for code that builds or inspects it.

In this version the ``checkpoint:`` section belongs to the ``checkpoint`` plugin (it is plain
data on the config, ``cfg.checkpoint.every_steps``), which declares each of its keys once
(``CheckpointOptions``). This class carries the five 2.0 fields with their 2.0 checks; their
defaults are read from that declaration, through the composed run schema. ``to_dict()`` gives
the section for ``SpeedtronicConfig.from_dict({"checkpoint": ...})``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import cast

from speedtronic.config.schema import ConfigError, schema_defaults

__all__ = ["CheckpointConfig"]

_SECTION = "checkpoint"


def _default(key: str) -> Callable[[], object]:
    """The declared default of ``checkpoint.<key>`` (the checkpoint plugin's)."""
    return lambda: schema_defaults(_SECTION)[key]


@dataclass
class CheckpointConfig:
    """``checkpoint:`` as 2.0 declared it: save every ``every_steps`` steps into
    ``directory`` (relative paths are under ``run.output_dir``), keep the last ``keep_last``
    (``None``: all), and ``resume`` from the latest checkpoint at start."""

    enabled: bool = field(default_factory=cast("Callable[[], bool]", _default("enabled")))
    directory: str = field(default_factory=cast("Callable[[], str]", _default("directory")))
    every_steps: int = field(default_factory=cast("Callable[[], int]", _default("every_steps")))
    keep_last: int | None = field(
        default_factory=cast("Callable[[], int | None]", _default("keep_last"))
    )
    resume: bool = field(default_factory=cast("Callable[[], bool]", _default("resume")))

    def __post_init__(self) -> None:
        if isinstance(self.every_steps, bool) or self.every_steps <= 0:
            raise ConfigError(f"checkpoint.every_steps must be positive, got {self.every_steps}")
        if self.keep_last is not None and (isinstance(self.keep_last, bool) or self.keep_last <= 0):
            raise ConfigError(
                f"checkpoint.keep_last must be positive or null, got {self.keep_last}"
            )

    def to_dict(self) -> dict[str, object]:
        """The section as plain data."""
        return asdict(self)
