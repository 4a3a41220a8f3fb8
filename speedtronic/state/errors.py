"""What can go wrong with a checkpoint: the errors of the storage layer.

Their own module so that every part of it -- the plain files (``archive``), the pointer
(``pointer``), the sharded directories (``sharded_checkpoint``), the manager
(``checkpoint``) and the one restricted loader they all read through (``safe_load``) --
raises the same classes without importing one another. ``speedtronic.state.checkpoint``
re-exports the classes (their public import path).
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

__all__ = [
    "CheckpointError",
    "CorruptCheckpointError",
    "UnsafeCheckpointError",
    "first_line",
    "write_error",
]


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


_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def write_error(path: Path, exc: Exception) -> CheckpointError:
    """The error of a failed write of ``path``; a full disk (or quota) says so plainly,
    with what is left there, wherever in the chain torch or the OS reported it."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _DISK_FULL:
            return CheckpointError(
                f"no space left on device: could not write {path} ({_free_space(path.parent)} "
                "free there); free some space or point checkpoint.directory elsewhere, then "
                "resume (--resume) from the last checkpoint, which is intact"
            )
        seen = seen.__cause__ or seen.__context__
    return CheckpointError(f"could not write {path}: {type(exc).__name__}: {exc}")


def _free_space(directory: Path) -> str:
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return "unknown space"
    return f"{free / 2**20:.1f} MiB"
