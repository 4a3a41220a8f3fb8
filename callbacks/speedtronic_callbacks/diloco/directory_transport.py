"""A DiLoCo hub in a directory shared by all nodes (local disk, NFS, SMB, a mounted bucket).

Writes go to a temporary sibling, are fsynced and atomically renamed
(``speedtronic.state.atomic_io``), so a reader sees either the old file or the complete new one,
never half of one.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from speedtronic.state.atomic_io import atomic_write_bytes
from speedtronic_callbacks.diloco.transport_base import (
    HubNotCreatedError,
    PermanentTransportError,
    RemoteFile,
    TransientTransportError,
    Transport,
    TransportError,
    UnreadableFileError,
    check_remote_path,
)

_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | _NONBLOCK | getattr(os, "O_BINARY", 0)
"""Open without following a final symbolic link and without blocking on a FIFO (whose
open would otherwise wait for a writer); the descriptor is checked before any read."""


class DirectoryTransport(Transport):
    """A hub in a directory (local disk, NFS, SMB, a mounted bucket).

    Atomicity comes from ``os.replace`` of a fully written, fsynced temporary file in the
    same directory; temporary files start with ``.`` and are never listed.

    Only regular files inside the root are read or written: a path whose file or any folder
    below the root is a symbolic link, and a file that is a FIFO, device or directory, is
    refused with ``UnreadableFileError`` without being opened for blocking reads, and a
    file larger than ``max_file_bytes`` is refused from its size alone.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().absolute()

    @property
    def location(self) -> str:
        return str(self.root)

    def _resolve(self, path: str) -> Path:
        return self.root.joinpath(*check_remote_path(path).split("/"))

    def _require_root(self, operation: str) -> None:
        if not self.root.is_dir():
            raise HubNotCreatedError(
                operation,
                f"hub directory {self.root} does not exist (the master creates it; check that "
                "the shared filesystem is mounted on this machine)",
            )

    def _refuse_linked_folders(self, path: str, operation: str) -> None:
        """``UnreadableFileError`` when a folder of ``path`` below the root is a symbolic
        link (it could lead out of the hub). Missing folders are fine."""
        folder = self.root
        for part in check_remote_path(path).split("/")[:-1]:
            folder = folder / part
            try:
                linked = stat.S_ISLNK(folder.lstat().st_mode)
            except FileNotFoundError:
                return
            except OSError as exc:
                raise self._os_error(operation, exc) from exc
            if linked:
                raise UnreadableFileError(
                    operation, f"{folder.relative_to(self.root)} is a symbolic link"
                )

    def prepare(self, *, create: bool) -> None:
        if create:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise self._os_error("prepare", exc) from exc
        self._require_root("prepare")

    def list_files(self, prefix: str) -> list[RemoteFile]:
        """Every entry under ``prefix`` that is not a folder, without following links:
        symbolic links to files and special files are listed (so that reading them is
        refused and reported); linked folders are never entered."""
        self._require_root("list")
        try:
            self._refuse_linked_folders(f"{prefix}/x", f"list {prefix}")
        except UnreadableFileError:
            return []  # a linked folder is not part of the hub
        base = self._resolve(prefix)
        if base.is_symlink():
            return []
        found: list[RemoteFile] = []
        try:
            for dirpath, dirnames, filenames in os.walk(base):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                for name in filenames:
                    if name.startswith("."):
                        continue  # a temporary file of a write in progress
                    full = Path(dirpath, name)
                    try:
                        info = full.lstat()
                    except FileNotFoundError:
                        continue  # deleted while listing
                    relative = full.relative_to(self.root).as_posix()
                    version = f"{info.st_mtime_ns}:{info.st_size}:{info.st_ino}:{info.st_mode}"
                    found.append(RemoteFile(relative, info.st_size, version))
        except OSError as exc:
            raise self._os_error("list", exc) from exc
        return sorted(found, key=lambda item: item.path)

    def get(self, path: str) -> bytes | None:
        target = self._resolve(path)
        self._require_root("get")
        self._refuse_linked_folders(path, f"get {path}")
        try:
            fd = os.open(target, _READ_FLAGS)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP or target.is_symlink():
                raise UnreadableFileError(f"get {path}", "is a symbolic link") from None
            raise self._os_error(f"get {path}", exc) from exc
        try:
            return self._read_regular(fd, path)
        except OSError as exc:
            raise self._os_error(f"get {path}", exc) from exc
        finally:
            os.close(fd)

    def _read_regular(self, fd: int, path: str) -> bytes:
        """The content of the open ``fd`` if it is a regular file within the size limit
        (checked before reading; a file that grows meanwhile is refused too)."""
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnreadableFileError(f"get {path}", "is not a regular file")
        self.check_file_size(info.st_size, path)
        if _NONBLOCK:
            os.set_blocking(fd, True)
        chunks: list[bytes] = []
        received = 0
        while chunk := os.read(fd, 1 << 20):
            received += len(chunk)
            self.check_file_size(received, path)  # it grew after the check above
            chunks.append(chunk)
        return b"".join(chunks)

    def put(self, path: str, data: bytes) -> None:
        target = self._resolve(path)
        self._require_root("put")
        self._refuse_linked_folders(path, f"put {path}")
        try:
            atomic_write_bytes(target, data)
        except OSError as exc:
            raise self._os_error(f"put {path}", exc) from exc

    def delete(self, paths: Sequence[str]) -> None:
        self._require_root("delete")
        for path in paths:
            self._refuse_linked_folders(path, f"delete {path}")
            try:
                self._resolve(path).unlink(missing_ok=True)
            except OSError as exc:
                raise self._os_error(f"delete {path}", exc) from exc

    @staticmethod
    def _os_error(operation: str, exc: OSError) -> TransportError:
        # Only a refusal is permanent; I/O errors, stale NFS handles and a full disk can
        # clear up, so they are retried.
        if isinstance(exc, PermissionError) or exc.errno in {errno.EROFS, errno.EACCES}:
            return PermanentTransportError(operation, f"permission denied: {exc}")
        return TransientTransportError(operation, str(exc))
