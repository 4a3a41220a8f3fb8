"""2.0's ``CheckpointConfig`` dataclass, kept for code that builds or inspects it.

In this version the ``checkpoint:`` section belongs to the ``checkpoint`` plugin (it is plain
data on the config, ``cfg.checkpoint.every_steps``); this class only carries the 2.0 fields
with their 2.0 defaults and checks. ``to_dict()`` gives the section for
``SpeedtronicConfig.from_dict({"checkpoint": ...})``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from speedtronic.config import ConfigError

__all__ = ["CheckpointConfig"]


@dataclass
class CheckpointConfig:
    """``checkpoint:`` as 2.0 declared it: save every ``every_steps`` steps into
    ``directory`` (relative paths are under ``run.output_dir``), keep the last ``keep_last``
    (``None``: all), and ``resume`` from the latest checkpoint at start."""

    enabled: bool = True
    directory: str = "checkpoints"
    every_steps: int = 500
    keep_last: int | None = 3
    resume: bool = False

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
