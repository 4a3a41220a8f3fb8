"""A DiLoCo hub in a directory shared by all nodes (local disk, NFS, SMB, a mounted bucket).

Writes go to a temporary sibling, are fsynced and atomically renamed
(``speedtronic.state.atomic_io``), so a reader sees either the old file or the complete new one,
never half of one.

``replace`` (how the master writes the pointer) swaps the new file in with Linux's
``renameat2(RENAME_EXCHANGE)`` where the kernel and filesystem support it: the file it
replaced comes out at the temporary name, so the master sees exactly what it published
over, even when someone wrote it a moment before. Elsewhere (other systems, NFS) it reads
the file and then replaces it, and a write in between goes unseen.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import sys
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from speedtronic.state.atomic_io import atomic_write_bytes, fsync_directory
from speedtronic_callbacks.diloco.transport_base import (
    HubNotCreatedError,
    PermanentTransportError,
    RemoteFile,
    Replaced,
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

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV, errno.EPERM}
"""``renameat2`` errors that mean "not here" (old kernel, a filesystem without it)."""


def _load_renameat2() -> Callable[[Path, Path, int], None] | None:
    """glibc's ``renameat2`` as ``rename2(source, target, flags)`` (``OSError`` on failure),
    or ``None`` off Linux or without it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    function.restype = ctypes.c_int

    def rename2(source: Path, target: Path, flags: int) -> None:
        if function(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), flags):
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), str(target))

    return rename2


_rename2 = _load_renameat2()


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

    def replace(self, path: str, data: bytes) -> Replaced:
        """``put`` that returns exactly what it replaced, by an atomic exchange where the OS
        has one (see the module docstring); otherwise ``Transport.replace``."""
        if _rename2 is None:
            return super().replace(path, data)
        target = self._resolve(path)
        self._require_root("put")
        self._refuse_linked_folders(path, f"put {path}")
        try:
            swapped = self._exchange(target, data, _rename2)
        except OSError as exc:
            raise self._os_error(f"put {path}", exc) from exc
        return super().replace(path, data) if swapped is None else swapped

    def _exchange(
        self, target: Path, data: bytes, rename2: Callable[[Path, Path, int], None]
    ) -> Replaced | None:
        """Write ``data`` to a fresh hidden sibling and swap it with ``target`` (or move it
        there when there is no file); ``None`` when this filesystem cannot swap."""
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = target.with_name(f".{target.name}.swap-{uuid.uuid4().hex}")
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            for _ in range(8):  # the target may appear or vanish between two attempts
                try:
                    rename2(staged, target, _RENAME_EXCHANGE)
                except FileNotFoundError:
                    try:
                        rename2(staged, target, _RENAME_NOREPLACE)
                    except FileExistsError:
                        continue
                    fsync_directory(target.parent)
                    return Replaced(None, exact=True)
                except OSError as exc:
                    if exc.errno in _UNSUPPORTED:
                        return None
                    raise
                fsync_directory(target.parent)
                return self._take_out(staged, target.name)
            raise OSError(errno.EAGAIN, "the file kept appearing and vanishing", str(target))
        finally:
            if staged.exists() or staged.is_symlink():
                self._remove_entry(staged)

    def _take_out(self, swapped: Path, name: str) -> Replaced:
        """What the exchange moved out to ``swapped``: read as ``get`` reads (a link, FIFO,
        directory or oversized file is not read: ``unreadable`` says which)."""
        try:
            fd = os.open(swapped, _READ_FLAGS)
        except OSError as exc:
            if exc.errno == errno.ELOOP or swapped.is_symlink():
                return Replaced(None, exact=True, unreadable="it was a symbolic link")
            raise
        try:
            return Replaced(self._read_regular(fd, name), exact=True)
        except UnreadableFileError as exc:
            return Replaced(None, exact=True, unreadable=exc.message)
        finally:
            os.close(fd)

    @staticmethod
    def _remove_entry(path: Path) -> None:
        """Remove what an exchange left at a temporary name (a file, link, FIFO or folder)."""
        try:
            if path.is_dir() and not path.is_symlink():
                path.rmdir()
            else:
                path.unlink()
        except OSError:
            pass  # a hidden name: never listed, and harmless

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
