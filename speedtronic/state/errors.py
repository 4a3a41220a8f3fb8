"""What can go wrong with a checkpoint: the errors of the storage layer.

Their own module so that every part of it -- the plain files (``checkpoint``), the sharded
directories (``sharded_checkpoint``) and the one restricted loader both read through
(``safe_load``) -- raises the same classes without importing one another.
``speedtronic.state.checkpoint`` re-exports them (their public import path).
"""

from __future__ import annotations

__all__ = ["CheckpointError", "CorruptCheckpointError", "UnsafeCheckpointError", "first_line"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, found or read."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file is truncated or damaged (``load_latest`` falls back past it)."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint holds pickled Python objects; it is refused rather than executed."""


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message, cut to ``limit`` characters: what an error
    of this layer quotes of the lower-level error it reports (torch's run to pages)."""
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= limit else line[:limit] + "..."
