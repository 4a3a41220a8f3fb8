"""Open a file someone named only when it is a regular file, and never block doing so.

``open()`` of a FIFO for reading waits for a writer -- forever when none comes -- and a
character device such as ``/dev/zero`` never ends. A file that a run or ``speedtronic
prepare`` opens by name (a manifest, a shard, a tokenizer, a corpus file, a pointer) is
therefore opened with ``O_NONBLOCK``, which makes opening a FIFO return at once, and the
*open descriptor* is checked with ``fstat`` (the file that will be read, not a name that may
have been replaced since a ``stat``) before a byte is read. ``O_NONBLOCK`` changes nothing
for reads of a regular file, so the handle is used as it is.

``_check_regular`` is the same check by name, for the few readers that must hand a path to a
library (it follows links, as opening does).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

__all__ = ["NotRegularFileError", "open_regular"]

_NON_BLOCKING = getattr(os, "O_NONBLOCK", 0)  # POSIX; Windows has no FIFOs to open by name
_BINARY = getattr(os, "O_BINARY", 0)  # Windows: no newline translation
_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)


class NotRegularFileError(OSError):
    """A path that names a FIFO, a device, a socket or a directory where a file was wanted."""

    def __init__(self, path: str | os.PathLike[str], kind: str) -> None:
        super().__init__(f"{os.fspath(path)}: {kind}, not a regular file")
        self.path = Path(path)
        self.kind = kind


def _file_kind(mode: int) -> str:
    """What a ``st_mode`` that is not a regular file's is, in words."""
    for test, kind in (
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return kind
    return "a special file"


def open_regular(path: str | os.PathLike[str], *, follow_links: bool = True) -> BinaryIO:
    """``open(path, "rb")`` that refuses, without blocking, anything but a regular file
    (``NotRegularFileError``); ``FileNotFoundError`` and other ``OSError``\\ s as ``open``.
    ``follow_links=False``: a symbolic link at ``path`` is refused too (``NotRegularFileError``
    of kind "a symbolic link"), for stores that hold only files this project wrote."""
    flags = os.O_RDONLY | _NON_BLOCKING | _BINARY | (0 if follow_links else _NO_FOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError:
        if not follow_links and os.path.islink(path):
            raise NotRegularFileError(path, "a symbolic link") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(path, _file_kind(mode))
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _check_regular(path: str | os.PathLike[str]) -> None:
    """Refuse a path that is not a regular file (``NotRegularFileError``), following links;
    ``FileNotFoundError`` when it does not exist."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise NotRegularFileError(path, _file_kind(mode))
