"""One checkpoint prefix in an object store: file-level operations, verified, and the retry policy.

``open_store(url, options)`` opens any fsspec URL (``s3://``, ``gs://``, ``file://``,
``memory://``, ...) without connecting; ``RemoteStore`` reads, writes, verifies and deletes
files under its root, and ``Retry`` runs an operation under a ``RetryPolicy`` (``tenacity``).
``speedtronic.state.remote`` builds the mirror on it, ``remote_owner`` the ownership
record, ``remote_fetch`` the download on resume.

A local store (``file://``, or a path) is a directory anyone with write access to it may
have planted things in, so its files are handled like the local checkpoint directory's:

* what is read must be a regular file -- opened without following a link and without
  blocking (``O_NOFOLLOW|O_NONBLOCK``), then checked with ``fstat``: a FIFO, a device or a
  symlink at ``latest.json``, ``owner.json`` or a checkpoint name is ``RemoteNotRegular``
  (never retried), instead of a read that blocks forever or follows the link elsewhere;
* what is written goes to a new hidden file created exclusively, never through a link
  (``atomic_io.create_temporary``), renamed into place: a symlink planted at a checkpoint
  name is replaced, its target is never written; a symlink planted at a sharded
  checkpoint's directory name is removed and a real directory made.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, TypeVar

from speedtronic.state.atomic_io import (
    atomic_write_bytes,
    create_temporary,
    fsync_directory,
)
from speedtronic.state.checkpoint import CheckpointError
from speedtronic.state.errors import first_line
from speedtronic.state.layout import checkpoint_step
from speedtronic.state.regular_file import NotRegularFileError
from speedtronic.state.regular_file import open_regular as open_regular_file
from speedtronic.state.sharded_checkpoint import SHARDED_SUFFIX
from speedtronic.util.retry import Backoff, retry

if TYPE_CHECKING:
    from fsspec.spec import AbstractFileSystem

__all__ = [
    "PIP_LINE",
    "RemoteError",
    "RemoteFile",
    "RemoteMismatch",
    "RemoteNotRegular",
    "RemoteStore",
    "Retry",
    "RetryPolicy",
    "describe_failure",
    "open_store",
]

logger = logging.getLogger("speedtronic.checkpoint")

PIP_LINE = "pip install 'speedtronic[remote]'"
_CHUNK = 8 * 1024 * 1024
_Result = TypeVar("_Result")


class RemoteError(CheckpointError):
    """The object store cannot be used: a missing extra, a URL fsspec does not know, or an
    operation that failed after its retries."""


class RemoteMismatch(RemoteError):
    """What the store holds is not what was uploaded (size or SHA-256 differ)."""


class RemoteNotRegular(RemoteError):
    """A local store holds something other than a regular file where one is read (a FIFO,
    a device, a symlink): planted, never read (it could block or lead elsewhere)."""


@dataclass(frozen=True)
class RetryPolicy(Backoff):
    """How often a store operation is tried (``attempts``) and how long to wait in
    between: exponential backoff with full jitter -- a random wait up to ``initial_s``,
    then up to twice that, ... at most ``max_s`` (``speedtronic.util.retry``)."""

    attempts: int = 5
    initial_s: float = 1.0
    max_s: float = 30.0


@dataclass(frozen=True)
class RemoteFile:
    """One uploaded file, as verified: its size and SHA-256."""

    size: int
    sha256: str

    def to_json(self) -> dict[str, object]:
        return {"size": self.size, "sha256": self.sha256}


def _remote_extra_missing() -> RemoteError:
    return RemoteError(
        f"checkpoint.remote needs the remote extra (fsspec, s3fs, tenacity): {PIP_LINE}"
    )


def open_store(url: str, options: Mapping[str, object] | None = None) -> RemoteStore:
    """The store at ``url`` (an fsspec URL) with fsspec storage ``options`` (for ``s3://``:
    ``endpoint_url``, ``client_kwargs``, ...). ``RemoteError`` when the extra (or the
    protocol's own package, e.g. ``s3fs``) is missing or fsspec cannot open the URL. Opens
    no connection."""
    try:
        import fsspec.core
        import tenacity  # noqa: F401 - the extra's other half, checked up front
    except ImportError as exc:
        raise _remote_extra_missing() from exc
    try:
        fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True, **dict(options or {}))
    except ImportError as exc:
        raise RemoteError(
            f"checkpoint.remote {url!r}: {first_line(exc)} -- install the remote extra: {PIP_LINE}"
        ) from exc
    except Exception as exc:  # ValueError "Protocol not known", a bad storage option, ...
        raise RemoteError(
            f"checkpoint.remote {url!r} cannot be opened: {type(exc).__name__}: {first_line(exc)}"
        ) from exc
    return RemoteStore(url, fs, str(root).rstrip("/"))


def open_regular(path: str, where: str) -> BinaryIO:
    """Open the local file ``path`` for reading if it is a regular file: never through a
    symlink, never blocking on a FIFO (``RemoteNotRegular`` naming ``where`` otherwise;
    ``FileNotFoundError`` when there is nothing). ``speedtronic.state.regular_file`` opens."""
    try:
        return open_regular_file(path, follow_links=False)
    except NotRegularFileError as exc:
        raise RemoteNotRegular(
            f"{where} is {exc.kind}, not a regular file; the store holds only files this "
            "project wrote (remove it)"
        ) from None


class RemoteStore:
    """One checkpoint directory in an object store (``open_store``): file-level operations
    with verification, no retries (the mirror and the fetch retry them)."""

    def __init__(self, url: str, fs: AbstractFileSystem, root: str) -> None:
        self.url = url.rstrip("/")
        self.fs = fs
        self.root = root
        protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
        self.local = "file" in protocols or "local" in protocols
        """A local file system: directories must exist, a rename is atomic, and what sits
        at a name may be a planted link or FIFO (module docstring)."""

    def __repr__(self) -> str:
        return f"RemoteStore({self.url!r})"

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def where(self, rel: str) -> str:
        """``rel`` as the user wrote the store: ``s3://bucket/run1/latest.json``."""
        return f"{self.url}/{rel}"

    @contextlib.contextmanager
    def _reading(self, rel: str) -> Iterator[BinaryIO]:
        path = self.path(rel)
        if self.local:
            with open_regular(path, self.where(rel)) as handle:
                yield handle
            return
        self.fs.invalidate_cache(path)
        with self.fs.open(path, "rb") as handle:
            yield handle

    def read_small(self, rel: str, limit: int) -> bytes | None:
        """At most ``limit + 1`` bytes of ``rel`` (a record: ``latest.json``,
        ``owner.json``), or ``None`` when there is none."""
        try:
            with self._reading(rel) as handle:
                data: bytes = handle.read(limit + 1)
        except FileNotFoundError:
            return None
        return data

    def write_small(self, rel: str, data: bytes) -> None:
        """Replace ``rel`` with ``data``: an object store's PUT is atomic; on a local file
        system a temp file (created exclusively, never through a link) is renamed."""
        if self.local:
            self._local_directory(self.root)
            atomic_write_bytes(self.path(rel), data)
            return
        self.fs.pipe_file(self.path(rel), data)

    def create_small(self, rel: str, data: bytes) -> bool:
        """Write ``rel`` only if nothing is there: ``False`` when something was. Local
        stores link a complete temp file into place (``link`` fails on any existing name,
        a link included); object stores PUT with ``If-None-Match: *`` -- a store that
        ignores it overwrites, which the caller's read-back catches."""
        path = self.path(rel)
        if self.local:
            self._local_directory(self.root)
            temporary, handle = create_temporary(Path(path))
            try:
                with handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.link(temporary, path)
            except FileExistsError:
                return False
            finally:
                with contextlib.suppress(OSError):
                    temporary.unlink()
            fsync_directory(self.root)
            return True
        try:
            self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        return True

    def upload(self, source: BinaryIO, rel: str) -> RemoteFile:
        """Stream ``source`` (from its start) to ``rel``, then verify it (``verify``)."""
        digest, size = hashlib.sha256(), 0
        source.seek(0)

        def copy(handle: BinaryIO) -> None:
            nonlocal size
            while chunk := source.read(_CHUNK):
                digest.update(chunk)
                handle.write(chunk)
                size += len(chunk)

        if self.local:
            self._upload_local(rel, copy)
        else:
            with self.fs.open(self.path(rel), "wb") as handle:
                copy(handle)
        uploaded = RemoteFile(size, digest.hexdigest())
        self.verify(rel, uploaded)
        return uploaded

    def _upload_local(self, rel: str, copy: Callable[[BinaryIO], None]) -> None:
        """A new file created exclusively, never through a link, renamed over ``rel``."""
        target = Path(self.path(rel))
        self._local_directory(self.root)
        if target.parent != Path(self.root):  # a sharded checkpoint's directory
            self._local_directory(str(target.parent))
        temporary, handle = create_temporary(target)
        try:
            with handle:
                copy(handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, target)  # replaces a planted link, never follows it
        except BaseException:
            with contextlib.suppress(OSError):
                temporary.unlink()
            raise
        fsync_directory(target.parent)

    def _local_directory(self, path: str) -> None:
        """A real directory at ``path``: a symlink planted there (inside the store) is
        removed, never followed; the store's root itself is the user's to place."""
        if path != self.root and os.path.islink(path):
            os.unlink(path)
        os.makedirs(path, exist_ok=True)

    def verify(self, rel: str, expected: RemoteFile) -> None:
        """``RemoteMismatch`` unless the store returns exactly ``expected``'s bytes at
        ``rel`` (its size, then its SHA-256, read back)."""
        digest, size = hashlib.sha256(), 0
        with self._reading(rel) as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
        if size != expected.size:
            raise RemoteMismatch(
                f"{self.where(rel)} holds {size} bytes, not the {expected.size} uploaded"
            )
        if digest.hexdigest() != expected.sha256:
            raise RemoteMismatch(f"{self.where(rel)} reads back with another SHA-256")

    def download(self, rel: str, into: BinaryIO, expected: RemoteFile) -> None:
        """Stream ``rel`` into ``into``; ``RemoteMismatch`` unless it is ``expected``
        (size and SHA-256), ``FileNotFoundError`` when the store has no ``rel``."""
        digest, size = hashlib.sha256(), 0
        with self._reading(rel) as handle:
            while chunk := handle.read(_CHUNK):
                size += len(chunk)
                if size > expected.size:
                    break
                digest.update(chunk)
                into.write(chunk)
        if size != expected.size or digest.hexdigest() != expected.sha256:
            raise RemoteMismatch(
                f"{self.where(rel)} does not match its upload record (size or SHA-256 "
                "differ: it was changed or damaged after it was uploaded)"
            )

    def remove(self, name: str) -> None:
        """Delete a checkpoint (a file, or a ``.dcp`` prefix); a missing one is fine."""
        path = self.path(name)
        if self.local and os.path.islink(path):  # the link, not what it points at
            os.unlink(path)
            return
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=name.endswith(SHARDED_SUFFIX))

    def checkpoint_names(self) -> list[str]:
        """Every checkpoint name directly under the root (complete or not)."""
        self.fs.invalidate_cache(self.root)
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        names = (str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in entries)
        return [name for name in names if checkpoint_step(name) is not None]


class Retry:
    """Runs a store operation under a ``RetryPolicy``: tried ``attempts`` times with
    jittered exponential backoff, the last error re-raised. Not retried: what a local store
    holds in place of a regular file, and the ``permanent`` errors (a local checkpoint
    that is gone, a download's missing or damaged file, another run's ownership record)."""

    def __init__(
        self,
        policy: RetryPolicy,
        what: str,
        permanent: tuple[type[BaseException], ...] = (),
    ) -> None:
        self._policy = policy
        self._what = what
        self._permanent: tuple[type[BaseException], ...] = (RemoteNotRegular, *permanent)

    def _log_retry(self, error: BaseException, seconds: float) -> None:
        logger.debug("checkpoint.remote: %s failed (%s); retrying", self._what, error)

    def __call__(self, operation: Callable[[], _Result]) -> _Result:
        return retry(
            self._policy,
            operation,
            retry_if=lambda error: not isinstance(error, self._permanent),
            on_retry=self._log_retry,
        )


def describe_failure(exc: BaseException) -> str:
    """An upload or download error in one line, with a hint for the usual causes."""
    text = f"{type(exc).__name__}: {first_line(exc)}"
    lowered = text.lower()
    if isinstance(exc, PermissionError) or any(
        word in lowered for word in ("credential", "access denied", "forbidden", "signature")
    ):
        return f"{text} (check the credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"
    if "bucket" in lowered and ("exist" in lowered or "nosuch" in lowered):
        return f"{text} (does the bucket exist?)"
    if "connect" in lowered or "endpoint" in lowered or isinstance(exc, ConnectionError):
        return f"{text} (is the endpoint reachable? checkpoint.remote_options.endpoint_url)"
    return text
