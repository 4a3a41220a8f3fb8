"""Keep a writer that is not a run out of the directories a live run holds.

A run locks its directories (``speedtronic.state.run_lock``: the lock file
``.speedtronic-run.lock`` with an exclusive ``flock`` held for the whole run), and a lock
covers everything under its directory. A command that writes a directory of its own --
``speedtronic export --output`` -- calls ``runs_kept_out(path)`` around its write:

* every lock file in ``path`` or one of its ancestors is opened read-only (never through a
  link, never blocking on a FIFO) and a *shared* ``flock`` is asked for without waiting:
  a live run holds the exclusive lock, so the request fails, and ``RunHeldError`` names
  the run (its host, PID and run directory, as the lock file records them);
* the shared locks are kept until the block ends, so a run that starts meanwhile finds its
  directory in use and stops, instead of the writer replacing files under it.

A lock file nobody holds (a finished or killed run) does not stop the writer. Without
``fcntl`` (Windows) a lock file that names a holder counts as held.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from speedtronic.state.run_lock import LOCK_NAME

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]  # optional module

__all__ = ["RunHeldError", "runs_kept_out"]

_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


class RunHeldError(RuntimeError):
    """A live run holds the directory (or one above it) that a command would write."""


def _holder(fd: int) -> str:
    """Who the lock file names, for the message."""
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
        holder = json.loads(text) if text else {}
    except (OSError, ValueError):
        holder = {}
    if not isinstance(holder, dict) or not holder:
        return "another process"
    run = holder.get("run_directory")
    where = f"; the run in {run}" if isinstance(run, str) else ""
    return f"PID {holder.get('pid')} on host {holder.get('host')}{where}"


def _lock_shared(lock: Path) -> int | None:
    """An fd holding a shared ``flock`` on ``lock``; ``None`` when there is no regular lock
    file there; ``RunHeldError`` when a run holds it."""
    try:
        fd = os.open(lock, _OPEN_FLAGS)
    except OSError:  # absent, a link, unreadable: no lock a run could hold through it
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                raise RunHeldError(
                    f"{lock.parent} is held by a live run ({_holder(fd)}; lock file {lock})"
                ) from None
        elif os.fstat(fd).st_size:  # no flock to ask: a named holder counts
            raise RunHeldError(f"{lock.parent} is held by a run ({_holder(fd)}; lock file {lock})")
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def runs_kept_out(path: Path) -> Iterator[None]:
    """Refuse ``path`` when a live run holds it or a directory above it, and keep runs
    from starting there until the block ends (module docstring)."""
    absolute = Path(os.path.abspath(path))
    held: list[int] = []
    try:
        for directory in (absolute, *absolute.parents):
            fd = _lock_shared(directory / LOCK_NAME)
            if fd is not None:
                held.append(fd)
        yield
    finally:
        for fd in held:
            os.close(fd)  # closing drops the shared flock
