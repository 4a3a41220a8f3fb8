"""A shard set in use is not replaced: readers hold a shared lock on its ``index.json``.

A run reads its shards through memory maps, opened again by name whenever a map was closed
(``MAX_OPEN_MAPS``), in every DataLoader worker and for each evaluation. If ``prepare
--overwrite`` swapped the directory under it, those opens would find the new files: a map
of the wrong length, or other tokens read silently. So whoever reads a shard set
(``open_token_dataset``: ``fit``, ``evaluate``) holds a shared ``flock`` on the set's
``index.json`` for as long as its dataset lives, and ``prepare --overwrite`` takes the
exclusive lock (without waiting) before it moves the old set aside -- refusing, with the
old set untouched, while any reader holds it. The lock is on the open file, so a reader
that opened an ``index.json`` just replaced (a swap between its open and its lock) finds
out by comparing inodes and locks the new one instead.

The lock is advisory (``flock``): it binds speedtronic processes, on file systems that
support it (local disks; NFS through its lock manager). Where ``fcntl`` does not exist
(Windows), or the file system has no locks (``ENOLCK``), nothing is locked.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import BinaryIO

from speedtronic.data.text import DataSourceError, open_data_file

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock
    fcntl = None  # type: ignore[assignment]  # optional module

__all__ = ["ShardsInUse", "ShardsInUseError", "hold_exclusive"]

_SHARED_WAIT_SECONDS = 60.0
"""How long a reader waits for a ``prepare`` that is swapping the set in (a rename or two)."""
_POLL_SECONDS = 0.05
_NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS})


class ShardsInUseError(DataSourceError):
    """A shard set that another process holds (a reader, or a ``prepare`` replacing it)."""


def _try_lock(handle: BinaryIO, operation: int) -> bool:
    if fcntl is None:  # pragma: no cover - Windows
        return True
    try:
        fcntl.flock(handle.fileno(), operation | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in _NO_LOCKS:  # a file system without locks: nothing to respect
            return True
        raise
    return True


def _same_file(handle: BinaryIO, path: Path) -> bool:
    """Whether ``path`` still names the file ``handle`` has open."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(handle.fileno())
    return (now.st_ino, now.st_dev) == (held.st_ino, held.st_dev)


class ShardsInUse:
    """A reader's shared lock on a shard set; released by ``close`` or when collected."""

    def __init__(self, directory: str | Path, manifest_name: str) -> None:
        self.path = Path(directory) / manifest_name
        self._handle: BinaryIO | None = None
        self._handle = self._acquire()

    def _acquire(self) -> BinaryIO | None:
        if fcntl is None:  # pragma: no cover - Windows
            return None
        deadline = time.monotonic() + _SHARED_WAIT_SECONDS
        while True:
            handle = open_data_file(self.path)
            if _try_lock(handle, fcntl.LOCK_SH) and _same_file(handle, self.path):
                return handle
            handle.close()
            if time.monotonic() > deadline:
                raise ShardsInUseError(
                    f"{self.path}: held by a prepare --overwrite replacing the shard set for "
                    f"over {_SHARED_WAIT_SECONDS:.0f} s"
                )
            time.sleep(_POLL_SECONDS)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()  # closing the file drops its lock
            self._handle = None

    def __del__(self) -> None:
        # A dataset dropped without a close (a later source of a mixture refused): its
        # lock goes with it, without a ResourceWarning.
        self.close()


def hold_exclusive(directory: Path, manifest_name: str, what: str) -> BinaryIO | None:
    """The exclusive lock on a shard set (``None`` where there are no locks): open the
    returned handle for as long as the set is being replaced, then close it.
    ``ShardsInUseError`` at once when a reader holds it (``what`` names the set)."""
    if fcntl is None:  # pragma: no cover - Windows
        return None
    handle = open_data_file(directory / manifest_name)
    if not _try_lock(handle, fcntl.LOCK_EX):
        handle.close()
        raise ShardsInUseError(
            f"{what}: a run is reading these shards (fit or evaluate holds "
            f"{directory / manifest_name}); --overwrite replaces them only when no run "
            "reads them: wait for it to end, or write to another --output"
        )
    return handle
