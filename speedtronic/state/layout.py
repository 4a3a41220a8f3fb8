"""The layout of a checkpoint directory: the names in it, and how a file gets there.

::

    latest.json                 {"step": 4, "file": "step_000000000004.pt",
                                 "checkpoints": {"step_000000000004.pt": {"sha256": ...}, ...}}
    step_000000000002.pt
    step_000000000004.pt
    .step_000000000006.pt.tmp-4242   a write in progress (or left by a killed process)
    step_000000000008.dcp/      a sharded checkpoint of an FSDP run: one directory, each
                                rank's shard in it (``speedtronic.state.sharded_checkpoint``)

    best.json                   latest.json's format for the best checkpoint by a monitored
                                metric, plus "monitor", "mode" and "value" (when asked for)

A checkpoint is ``step_<12 digits>.pt`` (or ``.dcp``); nothing else in the directory is
taken for one. Every file of the directory is written through ``write_atomically``: to a
hidden temp file in the same directory (created exclusively, never through a symlink:
``speedtronic.state.atomic_io``), flushed and fsynced, renamed onto its final name, and the
directory fsynced. Temp names carry the writer's PID (``.step_...pt.tmp-4242``, or
``.tmp-4242-<random>`` when that name is taken) and never end in ".pt", so they can never
match a checkpoint name, and the ones a killed process left are recognised by their dead
writer (``remove_stale_temp_files``).

The pointer files are ``speedtronic.state.pointer``; the order in which a save writes the
checkpoint, the pointer and deletes old ones is the manager's
(``speedtronic.state.checkpoint``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from speedtronic.state.atomic_io import atomic_write
from speedtronic.state.errors import CheckpointError, write_error

__all__ = [
    "BEST_POINTER_NAME",
    "MAX_STEP",
    "POINTER_NAME",
    "SHARDED_SUFFIX",
    "checkpoint_name",
    "checkpoint_step",
    "is_checkpoint_entry",
    "is_inside",
    "remove",
    "remove_stale_temp_files",
    "write_atomically",
]

POINTER_NAME = "latest.json"
"""The pointer file naming the newest complete checkpoint."""

BEST_POINTER_NAME = "best.json"
"""The pointer file naming the best checkpoint by a monitored metric (``note_best``)."""

SHARDED_SUFFIX = ".dcp"
"""The suffix of a sharded checkpoint's directory (``speedtronic.state.sharded_checkpoint``)."""

_STEP_DIGITS = 12
MAX_STEP = 10**_STEP_DIGITS - 1
"""The highest step a checkpoint file name can carry (12 digits: 31 years at 1 step/ms)."""
_CHECKPOINT_NAME = re.compile(rf"step_(\d{{{_STEP_DIGITS}}})\.(?:pt|dcp)")
_TEMP_NAME = re.compile(
    r"\.(?:step_\d+\.(?:pt|dcp)|latest\.json|best\.json)\.(?:tmp|old)-(\d{1,10})(?:-[0-9a-f]{16})?"
)
"""A temp name this layout writes: the writer's PID, then a random part when the plain name
was taken (``speedtronic.state.atomic_io.create_temporary``)."""
_MAX_PID = 2**31 - 1

PathLike = str | os.PathLike[str]


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint file name (``step_000000000012.pt`` -> 12; a sharded
    checkpoint's directory ``step_000000000012.dcp`` too), else ``None``.

    Only the exact ``step_<12 digits>.pt`` form counts: temp files, directories' other
    contents, anything with a path separator and junk such as ``step_99999999999999999.pt``
    (more digits than any save writes) are not checkpoints.
    """
    match = _CHECKPOINT_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def checkpoint_name(step: int) -> str:
    """``step_<step, 12 digits>.pt``; ``ValueError`` for a step no name can carry."""
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be in 0..{MAX_STEP}, got {step}")
    return f"step_{step:0{_STEP_DIGITS}d}.pt"


def is_checkpoint_entry(path: Path) -> bool:
    """A checkpoint file, or a sharded checkpoint's directory."""
    return path.is_dir() if path.suffix == SHARDED_SUFFIX else path.is_file()


def is_inside(path: Path, directory: Path) -> bool:
    """True when ``path`` really lives in ``directory`` (a symlink to a file elsewhere does
    not count: neither a pointer nor a scan may lead out of the directory)."""
    if not path.is_symlink():
        return path.parent == directory
    try:
        return path.resolve().parent == directory.resolve()
    except OSError:
        return False


def remove(path: Path) -> None:
    """Delete a checkpoint file or a sharded checkpoint's directory (or a temp of either)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


# -- writes -------------------------------------------------------------------------------


def write_atomically(path: Path, write_contents: Callable[[BinaryIO], None]) -> None:
    """``speedtronic.state.atomic_io.atomic_write`` with this layout's temp names (tagged
    with the writer's PID) and the storage layer's errors: ``CheckpointError`` for any
    failure, one that says so plainly for a full disk."""
    try:
        atomic_write(path, write_contents, tag=str(os.getpid()))
    except Exception as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise write_error(path, exc) from exc


def remove_stale_temp_files(directory: Path) -> list[Path]:
    """Delete the temp files and directories in ``directory`` whose writer no longer runs
    (a killed save's leftovers); returns what was deleted."""
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    for entry in directory.iterdir():
        match = _TEMP_NAME.fullmatch(entry.name)
        if match is None:
            continue
        pid = int(match.group(1))
        if pid == os.getpid() or _pid_alive(pid):
            continue
        with contextlib.suppress(OSError):
            remove(entry)
            removed.append(entry)
    return removed


def _pid_alive(pid: int) -> bool:
    if os.name != "posix":
        return True  # os.kill(pid, 0) would terminate the process on Windows: keep the file
    if not 0 < pid <= _MAX_PID:
        return False  # no process has it (a planted name; os.kill would overflow)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OSError:
        return True  # cannot tell: keep the file
    return True
