"""Write a file so that readers see the old content or the new one, never a torn mix.

The one way this project replaces a file in place: the content goes to a hidden temporary
sibling (``.<name>.tmp-<random>``, so it never matches a name a reader looks for), which is
flushed and fsynced, renamed over the target with ``os.replace`` (atomic on POSIX and
Windows), and the directory is fsynced so the rename itself survives a power cut. A failure
removes the temporary file and re-raises the original ``OSError``.

The temporary file is created with mode ``0o666`` filtered by the process umask, like a
plain ``open(path, "w")``, so files shared with other machines stay readable.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_write", "atomic_write_bytes", "atomic_write_text", "fsync_directory"]


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Make a rename or creation in ``directory`` durable. Best effort: some platforms and
    filesystems (Windows, some network mounts) cannot open or fsync a directory."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def temporary_sibling(path: Path) -> Path:
    """A fresh hidden name next to ``path`` for a write in progress."""
    return path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")


def atomic_write(
    path: str | os.PathLike[str],
    write_contents: Callable[[BinaryIO], None],
    *,
    temporary: Path | None = None,
) -> None:
    """Replace ``path`` with what ``write_contents`` writes into the binary handle it gets.

    Missing parent directories are created (and their own entries fsynced). ``temporary``
    names the write-in-progress file when the caller recognises its own leftovers by name
    (checkpoints put the writer's PID there); it is truncated if it exists.
    """
    target = Path(path)
    if not target.parent.is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        fsync_directory(target.parent.parent)
    # Opened by name (not from a descriptor) so writers that look at ``handle.name``, such
    # as torch.save, see a path; a name we chose ourselves must not exist yet.
    exclusive = temporary is None
    temporary = temporary_sibling(target) if temporary is None else temporary
    try:
        with open(temporary, "xb") if exclusive else open(temporary, "wb") as handle:
            write_contents(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
    fsync_directory(target.parent)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably."""

    def write(handle: BinaryIO) -> None:
        handle.write(data)

    atomic_write(path, write)


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> None:
    """Replace ``path`` with ``text`` (encoded, newlines untranslated) atomically and durably."""
    atomic_write_bytes(path, text.encode(encoding))
