"""The project's error for invalid configuration, in a leaf module: the config layer raises
it, and so do the building blocks below it (a model's options, ``models/hf.py``), which must not
import the config layer. ``speedtronic.config`` and ``speedtronic`` re-export it."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """Invalid configuration. ``errors`` lists every problem, each starting with its path
    (``optimizer.lr: -1 is less than or equal to the minimum of 0``)."""

    def __init__(self, errors: str | Sequence[str], *, source: str | None = None) -> None:
        self.errors: list[str] = [errors] if isinstance(errors, str) else list(errors)
        self.source = source
        super().__init__(self._render())

    def _render(self) -> str:
        where = f" in {self.source}" if self.source else ""
        if len(self.errors) == 1:
            return f"invalid configuration{where}: {self.errors[0]}"
        lines = "\n".join(f"  - {error}" for error in self.errors)
        return f"{len(self.errors)} configuration errors{where}:\n{lines}"

    def __str__(self) -> str:
        return self._render()
