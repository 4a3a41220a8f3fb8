"""A DiLoCo hub in a directory shared by all nodes (local disk, NFS, SMB, a mounted bucket).

Writes go to a temporary sibling, are fsynced and atomically renamed
(``speedtronic.atomic_io``), so a reader sees either the old file or the complete new one,
never half of one.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from pathlib import Path

from speedtronic.atomic_io import atomic_write_bytes
from speedtronic_callbacks.diloco.transport_base import (
    PermanentTransportError,
    RemoteFile,
    TransientTransportError,
    Transport,
    TransportError,
    check_remote_path,
)


class DirectoryTransport(Transport):
    """A hub in a directory (local disk, NFS, SMB, a mounted bucket).

    Atomicity comes from ``os.replace`` of a fully written, fsynced temporary file in the
    same directory; temporary files start with ``.`` and are never listed.
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
            raise PermanentTransportError(
                operation,
                f"hub directory {self.root} does not exist (the master creates it; check that "
                "the shared filesystem is mounted on this machine)",
            )

    def prepare(self, *, create: bool) -> None:
        if create:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise self._os_error("prepare", exc) from exc
        self._require_root("prepare")

    def list_files(self, prefix: str) -> list[RemoteFile]:
        self._require_root("list")
        base = self._resolve(prefix)
        found: list[RemoteFile] = []
        try:
            for dirpath, dirnames, filenames in os.walk(base):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                for name in filenames:
                    if name.startswith("."):
                        continue  # a temporary file of a write in progress
                    full = Path(dirpath, name)
                    try:
                        stat = full.stat()
                    except FileNotFoundError:
                        continue  # deleted while listing
                    relative = full.relative_to(self.root).as_posix()
                    version = f"{stat.st_mtime_ns}:{stat.st_size}:{stat.st_ino}"
                    found.append(RemoteFile(relative, stat.st_size, version))
        except OSError as exc:
            raise self._os_error("list", exc) from exc
        return sorted(found, key=lambda item: item.path)

    def get(self, path: str) -> bytes | None:
        target = self._resolve(path)
        self._require_root("get")
        try:
            return target.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._os_error(f"get {path}", exc) from exc

    def put(self, path: str, data: bytes) -> None:
        target = self._resolve(path)
        self._require_root("put")
        try:
            atomic_write_bytes(target, data)
        except OSError as exc:
            raise self._os_error(f"put {path}", exc) from exc

    def delete(self, paths: Sequence[str]) -> None:
        self._require_root("delete")
        for path in paths:
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
