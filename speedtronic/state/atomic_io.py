"""Write a file so that readers see the old content or the new one, never a torn mix.

The one way this project replaces a file in place: the content goes to a hidden temporary
sibling (``.<name>.tmp-<random>``, so it never matches a name a reader looks for), which is
flushed and fsynced, renamed over the target with ``os.replace`` (atomic on POSIX and
Windows), and the directory is fsynced so the rename itself survives a power cut. A failure
removes the temporary file and re-raises the original ``OSError``.

The temporary file is created exclusively and without following links (``O_CREAT|O_EXCL|
O_NOFOLLOW``): someone who can write the directory and plants a symlink (or any file) at a
temp name cannot make a save write through it to a file elsewhere, nor truncate what is
there -- the save takes another name. The rename replaces the directory *entry*, so a
symlink planted at the target's own name is replaced, not followed.

The temporary file is created with mode ``0o666`` filtered by the process umask, like a
plain ``open(path, "w")``, so files shared with other machines stay readable.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TypeVar

__all__ = [
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_text",
    "create_temporary",
    "create_temporary_directory",
    "fsync_directory",
]


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


_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)  # POSIX; Windows has no symlinks to follow here
_NAME_ATTEMPTS = 100
_Created = TypeVar("_Created")


def _open_exclusive(path: str, flags: int) -> int:
    """``open``'s opener: create ``path`` (``"x"`` mode: ``O_CREAT|O_EXCL``) and never
    through a symlink, not even a dangling one."""
    return os.open(path, flags | _NO_FOLLOW, 0o666)


def create_temporary(target: Path, tag: str | None = None) -> tuple[Path, BinaryIO]:
    """A new hidden file next to ``target`` for a write in progress, opened for reading and
    writing: ``.<name>.tmp-<tag>`` when that name is free, else (or without a ``tag``) one
    with a random suffix. Whatever already sits at a name -- a leftover, or a symlink planted
    to redirect the write elsewhere -- is never opened, truncated or followed."""

    def create(temporary: Path) -> tuple[Path, BinaryIO]:
        return temporary, open(temporary, "x+b", opener=_open_exclusive)  # noqa: SIM115

    return _claim(target, tag, create)


def create_temporary_directory(target: Path, tag: str | None = None) -> Path:
    """``create_temporary`` for a directory (``os.mkdir``, which never follows a link)."""

    def create(temporary: Path) -> Path:
        os.mkdir(temporary)
        return temporary

    return _claim(target, tag, create)


def _claim(target: Path, tag: str | None, create: Callable[[Path], _Created]) -> _Created:
    """``create`` at the first free temp name next to ``target``."""
    for attempt in range(_NAME_ATTEMPTS):
        suffix = tag if tag is not None and attempt == 0 else None
        if suffix is None:
            suffix = secrets.token_hex(8) if tag is None else f"{tag}-{secrets.token_hex(8)}"
        try:
            return create(target.with_name(f".{target.name}.tmp-{suffix}"))
        except FileExistsError:
            continue
    raise FileExistsError(
        errno.EEXIST, f"no free temporary name next to {target} after {_NAME_ATTEMPTS} tries"
    )


def atomic_write(
    path: str | os.PathLike[str],
    write_contents: Callable[[BinaryIO], None],
    *,
    tag: str | None = None,
) -> None:
    """Replace ``path`` with what ``write_contents`` writes into the binary handle it gets
    (open for reading too, at the start of an empty file; its ``name`` is the temporary
    file's path).

    Missing parent directories are created (and their own entries fsynced). The temporary
    file is created exclusively, never through a link (``create_temporary``); ``tag`` goes
    into its name when the caller recognises its own leftovers by name (checkpoints put
    the writer's PID there).
    """
    target = Path(path)
    if not target.parent.is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        fsync_directory(target.parent.parent)
    temporary, handle = create_temporary(target, tag)
    try:
        with handle:
            write_contents(handle)
            handle.flush()
            os.fsync(handle.fileno())
        # os.replace renames the entry itself: a symlink planted at ``path`` is replaced,
        # never written through.
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
