"""Open a run's file to append to it, never through a symbolic link planted at its name.

A run appends to files it keeps open: the metric sinks' ``metrics.jsonl`` and
``metrics.csv``, the console's ``logging.file``, the lock files of ``run_lock``, the DiLoCo
master's audit log. Someone who can write the run directory could put a symbolic link at
such a name and have the run append to -- or create -- any file the run's user may write.
``open_to_append`` opens the final component with ``O_NOFOLLOW``, so a link there is
refused with ``PlantedLinkError`` (an ``OSError`` naming the path and where the link leads)
and nothing is opened. Regular files, devices and FIFOs open as before.

The links the system keeps under ``/dev`` and ``/proc`` (``/dev/stdout``, ``/dev/fd/2``,
``/proc/self/fd/1``) are followed: users name them on purpose, and only root can plant one
there (``system_path``; a folder there that others may write, such as ``/dev/shm``, gets
no such trust). Folders above the final component are followed as usual: a link
among them was made by whoever set the directories up, not by a writer of the directory.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import IO

__all__ = ["PlantedLinkError", "open_to_append", "refuse_planted_link", "system_path"]

_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)  # POSIX; Windows has no such links to follow here
_SYSTEM_DIRECTORIES = (Path("/dev"), Path("/proc"))
_LINK_ERRORS = (errno.ELOOP, errno.EMLINK)  # Linux and macOS say ELOOP; FreeBSD EMLINK


class PlantedLinkError(OSError):
    """A symbolic link sits where a run appends to a file of its own: refused, not followed."""


def system_path(path: Path) -> bool:
    """True for a path whose folder is (or leads into) ``/dev`` or ``/proc`` and is writable
    by its owner alone (``/dev/shm`` and the like, which anyone may write, do not count)."""
    if os.name != "posix":
        return False
    folder = Path(os.path.abspath(path)).parent.resolve()
    if not any(folder.is_relative_to(root) for root in _SYSTEM_DIRECTORIES):
        return False
    try:
        return not folder.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    except OSError:
        return False


def _planted(path: Path) -> PlantedLinkError:
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return PlantedLinkError(
        errno.ELOOP,
        f"it is a symbolic link (to {target}), and a run never writes through a link at its "
        "own file name: remove the link, or name the file it leads to",
        str(path),
    )


def refuse_planted_link(path: Path) -> None:
    """``PlantedLinkError`` when ``path`` is a symbolic link outside ``/dev`` and ``/proc``
    (check before anything else reads or renames the file through its name)."""
    if path.is_symlink() and not system_path(path):
        raise _planted(path)


def open_to_append(
    path: Path,
    *,
    read: bool = False,
    buffering: int = -1,
    newline: str | None = None,
) -> IO[str]:
    """``path`` opened as UTF-8 text to append to (created if missing, mode ``0o666`` under
    the umask, like ``open(path, "a")``; ``read``: ``"a+"``), never through a link at its
    name (``PlantedLinkError``). Other failures are the ``OSError`` of ``open``."""
    flags = (os.O_RDWR if read else os.O_WRONLY) | os.O_APPEND | os.O_CREAT
    flags |= getattr(os, "O_CLOEXEC", 0)
    if not system_path(path):
        flags |= _NO_FOLLOW
    try:
        descriptor = os.open(path, flags, 0o666)
    except OSError as exc:
        if exc.errno in _LINK_ERRORS and path.is_symlink():
            raise _planted(path) from None
        raise
    return open(  # noqa: SIM115  # the caller closes it
        descriptor, "a+" if read else "a", encoding="utf-8", buffering=buffering, newline=newline
    )
