"""Object-store copies of committed checkpoints: uploaded in the background, fetched on resume.

``checkpoint.remote: s3://bucket/run1`` (any fsspec URL: ``gs://``, ``az://``, ``file://``,
``memory://``, ...) mirrors the checkpoint directory into the store::

    s3://bucket/run1/
        latest.json                 the remote commit record, written last (below)
        step_000000000010.pt
        step_000000000020.dcp/manifest.json, state.pt, .metadata, __0_0.distcp, ...

Uploading (``RemoteMirror``, one background thread: ``checkpoint_async.LatestJobWorker``).
After the local commit (the local ``latest.json`` names the checkpoint) its path is handed
to the mirror, which never blocks the training thread; a checkpoint still waiting when a
newer one commits is dropped for it. One upload:

1. every file of the checkpoint is streamed to the store (its SHA-256 computed on the way),
   then verified: its size and SHA-256 read back from the store must match;
2. only then is the remote ``latest.json`` rewritten to name it, with a record per kept
   remote checkpoint: the local pointer's checksum (what a local load verifies), the loss,
   and every file's size and SHA-256 -- a reader never finds a pointer to an incomplete
   upload;
3. then retention, the local rules applied to the remote records: all but the newest
   ``keep_last`` are deleted (never the one just uploaded, nor the newest with a finite
   loss) -- after the pointer stopped recording them, and so only once their replacement
   is verified -- and so are uploads that no pointer records (cut short by a kill).

Re-uploading a step the remote pointer records with other content first rewrites the
pointer without it. Every store operation is retried with jittered exponential backoff
(``tenacity``; ``RetryPolicy``); an upload that still fails is reported once (one warning
until an upload succeeds again) and training goes on -- the checkpoint stays local and the
next one is tried. Nothing remote is deleted on a failed upload.

Fetching (``fetch_newer``, on resume, before the local load). When the remote pointer
names a newer step than the local directory holds -- a fresh machine's empty directory --
its checkpoint is downloaded into the local directory (a hidden temp file or directory,
renamed into place, like a local save), every file checked against its upload record, and
the local ``latest.json`` is pointed at it with its checksum; the normal resume then loads
and verifies it. A pointer naming a missing checkpoint, a file whose checksum does not
match, an unreadable pointer: each is one warning, and the resume continues from the
next older remote checkpoint, else from the local directory.

``fsspec`` (with ``s3fs`` for ``s3://``) and ``tenacity`` are the ``remote`` extra; this
module imports them only when a store is opened (``RemoteError`` naming the pip line when
they are missing).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, TypeVar

from speedtronic.state.archive import archive_checksum
from speedtronic.state.atomic_io import (
    atomic_write,
    atomic_write_bytes,
    create_temporary_directory,
    fsync_directory,
)
from speedtronic.state.checkpoint import CheckpointError, CheckpointManager
from speedtronic.state.checkpoint_async import LatestJobWorker
from speedtronic.state.errors import first_line
from speedtronic.state.layout import POINTER_NAME, checkpoint_step
from speedtronic.state.pointer import MAX_POINTER_BYTES, atomic_json_dump, decode_pointer_bytes
from speedtronic.state.sharded_checkpoint import MANIFEST_NAME, SHARDED_SUFFIX

if TYPE_CHECKING:
    from fsspec.spec import AbstractFileSystem

__all__ = [
    "PIP_LINE",
    "RemoteError",
    "RemoteFile",
    "RemoteMirror",
    "RemotePointer",
    "RemoteRecord",
    "RemoteStore",
    "RetryPolicy",
    "fetch_newer",
    "open_store",
    "parse_remote_pointer",
]

logger = logging.getLogger("speedtronic.checkpoint")

PIP_LINE = "pip install 'speedtronic[remote]'"
_CHUNK = 8 * 1024 * 1024
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_SHARD_FILE = r"(?:state\.pt|\.metadata|manifest\.json|__\d{1,9}_\d{1,9}\.distcp)"
_REMOTE_FILE = re.compile(rf"(step_\d{{12}}\.pt)|(step_\d{{12}}\.dcp)/{_SHARD_FILE}")
_Result = TypeVar("_Result")


class RemoteError(CheckpointError):
    """The object store cannot be used: a missing extra, a URL fsspec does not know, or an
    operation that failed after its retries."""


class RemoteMismatch(RemoteError):
    """What the store holds is not what was uploaded (size or SHA-256 differ)."""


@dataclass(frozen=True)
class RetryPolicy:
    """How often a store operation is tried (``attempts``) and how long to wait in
    between: exponential backoff with full jitter -- a random wait up to ``initial_s``,
    then up to twice that, ... at most ``max_s``."""

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


@dataclass(frozen=True)
class RemoteRecord:
    """A verified remote checkpoint: ``name`` (``step_...pt`` or ``.dcp``), the checksum
    the local pointer records for it (``None``: unknown), its loss entries and its files
    (path under the remote root -> size and SHA-256)."""

    name: str
    checksum: str | None
    files: dict[str, RemoteFile]
    loss: dict[str, object] = field(default_factory=dict)

    @property
    def step(self) -> int:
        step = checkpoint_step(self.name)
        assert step is not None
        return step

    @property
    def finite(self) -> bool:
        return self.loss.get("finite_loss") is not False

    def to_json(self) -> dict[str, object]:
        record: dict[str, object] = {
            **self.loss,
            "files": {rel: item.to_json() for rel, item in sorted(self.files.items())},
        }
        if self.checksum is not None:
            record["sha256"] = self.checksum
        return record

    def local_record(self) -> dict[str, object]:
        """Its record in the local ``latest.json`` (checksum and loss)."""
        record: dict[str, object] = dict(self.loss)
        if self.checksum is not None:
            record["sha256"] = self.checksum
        return record


@dataclass(frozen=True)
class RemotePointer:
    """The remote ``latest.json``: the checkpoint it names and every kept one's record."""

    target: str
    records: dict[str, RemoteRecord]

    def newest_first(self) -> list[RemoteRecord]:
        """The target's record, then the older records, newest first."""
        target = self.records[self.target]
        older = [r for r in self.records.values() if r.step < target.step]
        return [target, *sorted(older, key=lambda r: r.step, reverse=True)]


def parse_remote_pointer(data: bytes) -> tuple[RemotePointer | None, str | None]:
    """Decode and validate remote ``latest.json`` bytes: ``(pointer, None)``, or ``(None,
    problem)``. Never raises for any input (size-capped, bounded nesting)."""
    content, problem = decode_pointer_bytes(data)
    if problem is not None:
        return None, problem
    if not isinstance(content, dict) or not isinstance(content.get("file"), str):
        return None, 'it must be a JSON object with a string "file"'
    target = str(content["file"])
    step = checkpoint_step(target)
    if step is None:
        return None, f"{target[:80]!r} is not a checkpoint name"
    if content.get("step") not in (None, step):
        return None, f'its "step" does not match file {target!r}'
    table = content.get("checkpoints")
    if not isinstance(table, dict):
        return None, '"checkpoints" must be an object mapping names to records'
    records: dict[str, RemoteRecord] = {}
    for name, value in table.items():
        record, problem = _parse_record(name, value)
        if record is None:
            return None, problem
        records[name] = record
    if target not in records:
        return None, f"it names {target!r} but has no record of it"
    return RemotePointer(target, records), None


def _parse_record(name: object, value: object) -> tuple[RemoteRecord | None, str]:
    if not isinstance(name, str) or checkpoint_step(name) is None or not isinstance(value, dict):
        return None, f'"checkpoints" has an invalid entry {str(name)[:80]!r}'
    checksum = value.get("sha256")
    if checksum is not None and not (isinstance(checksum, str) and _SHA256_HEX.fullmatch(checksum)):
        return None, f"the record of {name!r} has an invalid sha256"
    files = value.get("files")
    if not isinstance(files, dict) or not files:
        return None, f"the record of {name!r} lists no files"
    parsed: dict[str, RemoteFile] = {}
    for rel, item in files.items():
        match = _REMOTE_FILE.fullmatch(rel) if isinstance(rel, str) else None
        size = item.get("size") if isinstance(item, dict) else None
        digest = item.get("sha256") if isinstance(item, dict) else None
        if (
            match is None
            or (match.group(1) or match.group(2)) != name
            or isinstance(size, bool)
            or not isinstance(size, int)
            or size < 0
            or not isinstance(digest, str)
            or not _SHA256_HEX.fullmatch(digest)
        ):
            return None, f"the record of {name!r} has an invalid file entry {str(rel)[:80]!r}"
        parsed[rel] = RemoteFile(size, digest)
    loss = {key: value[key] for key in ("loss", "finite_loss") if key in value}
    return RemoteRecord(name, checksum if isinstance(checksum, str) else None, parsed, loss), ""


# -- the store -------------------------------------------------------------------------------


def _import_fsspec() -> object:
    try:
        import fsspec
    except ImportError as exc:
        raise RemoteError(
            f"checkpoint.remote needs the remote extra (fsspec, s3fs, tenacity): {PIP_LINE}"
        ) from exc
    return fsspec


def open_store(url: str, options: Mapping[str, object] | None = None) -> RemoteStore:
    """The store at ``url`` (an fsspec URL) with fsspec storage ``options`` (for ``s3://``:
    ``endpoint_url``, ``client_kwargs``, ...). ``RemoteError`` when the extra (or the
    protocol's own package, e.g. ``s3fs``) is missing or fsspec cannot open the URL. Opens
    no connection."""
    _import_fsspec()
    _import_tenacity()
    import fsspec.core

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


def _import_tenacity() -> object:
    try:
        import tenacity
    except ImportError as exc:
        raise RemoteError(
            f"checkpoint.remote needs the remote extra (fsspec, s3fs, tenacity): {PIP_LINE}"
        ) from exc
    return tenacity


class RemoteStore:
    """One checkpoint directory in an object store (``open_store``): file-level operations
    with verification, no retries (``RemoteMirror`` and ``fetch_newer`` retry them)."""

    def __init__(self, url: str, fs: AbstractFileSystem, root: str) -> None:
        self.url = url.rstrip("/")
        self.fs = fs
        self.root = root
        protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
        self.local = "file" in protocols or "local" in protocols
        """A local file system: directories must exist, a rename is atomic."""

    def __repr__(self) -> str:
        return f"RemoteStore({self.url!r})"

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def where(self, rel: str) -> str:
        """``rel`` as the user wrote the store: ``s3://bucket/run1/latest.json``."""
        return f"{self.url}/{rel}"

    def read_pointer(self) -> bytes | None:
        """The remote ``latest.json`` (at most a byte more than a pointer may be), or
        ``None`` when there is none."""
        path = self.path(POINTER_NAME)
        self.fs.invalidate_cache(path)
        try:
            with self.fs.open(path, "rb") as handle:
                data: bytes = handle.read(MAX_POINTER_BYTES + 1)
        except FileNotFoundError:
            return None
        return data

    def write_pointer(self, data: bytes) -> None:
        """Replace the remote ``latest.json``: an object store's PUT is atomic; on a local
        file system a temp file is renamed into place."""
        if self.local:
            atomic_write_bytes(self.path(POINTER_NAME), data)
            return
        with self.fs.open(self.path(POINTER_NAME), "wb") as handle:
            handle.write(data)

    def upload(self, source: BinaryIO, rel: str) -> RemoteFile:
        """Stream ``source`` (from its start) to ``rel``, then verify it (``verify``)."""
        path = self.path(rel)
        if self.local:
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        digest, size = hashlib.sha256(), 0
        source.seek(0)
        with self.fs.open(path, "wb") as handle:
            while chunk := source.read(_CHUNK):
                digest.update(chunk)
                handle.write(chunk)
                size += len(chunk)
        uploaded = RemoteFile(size, digest.hexdigest())
        self.verify(rel, uploaded)
        return uploaded

    def verify(self, rel: str, expected: RemoteFile) -> None:
        """``RemoteMismatch`` unless the store returns exactly ``expected``'s bytes at
        ``rel`` (its size, then its SHA-256, read back)."""
        path = self.path(rel)
        self.fs.invalidate_cache(path)
        size = self.fs.info(path).get("size")
        if size != expected.size:
            raise RemoteMismatch(
                f"{self.where(rel)} holds {size} bytes, not the {expected.size} uploaded"
            )
        digest = hashlib.sha256()
        with self.fs.open(path, "rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
        if digest.hexdigest() != expected.sha256:
            raise RemoteMismatch(f"{self.where(rel)} reads back with another SHA-256")

    def download(self, rel: str, into: BinaryIO, expected: RemoteFile) -> None:
        """Stream ``rel`` into ``into``; ``RemoteMismatch`` unless it is ``expected``
        (size and SHA-256), ``FileNotFoundError`` when the store has no ``rel``."""
        digest, size = hashlib.sha256(), 0
        with self.fs.open(self.path(rel), "rb") as handle:
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
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(name), recursive=name.endswith(SHARDED_SUFFIX))

    def checkpoint_names(self) -> list[str]:
        """Every checkpoint name directly under the root (complete or not)."""
        self.fs.invalidate_cache(self.root)
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        names = (str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in entries)
        return [name for name in names if checkpoint_step(name) is not None]


class _Retry:
    """Runs a store operation under a ``RetryPolicy``: tried ``attempts`` times with
    jittered exponential backoff, the last error re-raised. Not retried: a local file that
    is gone, and the ``permanent`` errors (a download's missing or damaged file)."""

    def __init__(
        self,
        policy: RetryPolicy,
        what: str,
        permanent: tuple[type[BaseException], ...] = (),
    ) -> None:
        from tenacity import (
            Retrying,
            retry_if_not_exception_type,
            stop_after_attempt,
            wait_random_exponential,
        )

        def log_retry(state: object) -> None:
            outcome = getattr(state, "outcome", None)
            error = outcome.exception() if outcome is not None else None
            logger.debug("checkpoint.remote: %s failed (%s); retrying", what, error)

        self._retrying = Retrying(
            stop=stop_after_attempt(policy.attempts),
            wait=wait_random_exponential(multiplier=policy.initial_s, max=policy.max_s),
            retry=retry_if_not_exception_type((_LocalGone, *permanent)),
            before_sleep=log_retry,
            reraise=True,
        )

    def __call__(self, operation: Callable[[], _Result]) -> _Result:
        return self._retrying(operation)


class _LocalGone(Exception):
    """The local checkpoint being uploaded was deleted meanwhile (a newer one replaced it)."""


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


# -- uploading -------------------------------------------------------------------------------


@dataclass
class _LocalCheckpoint:
    """A committed local checkpoint opened for upload (open handles survive its deletion
    by local retention meanwhile)."""

    name: str
    files: list[tuple[str, BinaryIO]]  # (path under the remote root, handle), manifest last

    def close(self) -> None:
        for _, handle in self.files:
            handle.close()


def _open_local(path: Path) -> _LocalCheckpoint:
    """Open every file of the checkpoint ``path``; ``_LocalGone`` when it is gone."""
    name = path.name
    files: list[tuple[str, BinaryIO]] = []
    try:
        if path.suffix == SHARDED_SUFFIX:
            entries = sorted(
                (entry for entry in path.iterdir() if entry.is_file() and not entry.is_symlink()),
                key=lambda entry: (entry.name == MANIFEST_NAME, entry.name),
            )
            for entry in entries:
                files.append((f"{name}/{entry.name}", open(entry, "rb")))  # noqa: SIM115
        else:
            files.append((name, open(path, "rb")))  # noqa: SIM115
    except FileNotFoundError as exc:
        for _, handle in files:
            handle.close()
        raise _LocalGone(str(path)) from exc
    return _LocalCheckpoint(name, files)


def _sha256_of(handle: BinaryIO) -> RemoteFile:
    digest, size = hashlib.sha256(), 0
    handle.seek(0)
    while chunk := handle.read(_CHUNK):
        digest.update(chunk)
        size += len(chunk)
    return RemoteFile(size, digest.hexdigest())


def _local_pointer(path: Path) -> dict[str, object]:
    """The local ``latest.json`` as an object, ``{}`` when it is missing or unusable: what
    the remote side reads of it (the step, records, losses) it reads leniently, since the
    manager's own reading is what reports a damaged pointer."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_POINTER_BYTES + 1)
    except OSError:
        return {}
    content, problem = decode_pointer_bytes(data)
    return content if problem is None and isinstance(content, dict) else {}


def _local_loss(directory: Path, name: str) -> dict[str, object]:
    """The loss entries the local pointer records for ``name`` (``{}``: none)."""
    table = _local_pointer(directory / POINTER_NAME).get("checkpoints")
    record = table.get(name) if isinstance(table, dict) else None
    if not isinstance(record, dict):
        return {}
    loss = record.get("loss")
    finite = record.get("finite_loss")
    found: dict[str, object] = {}
    if isinstance(loss, (int, float, str)) and not isinstance(loss, bool):
        found["loss"] = loss
    if isinstance(finite, bool):
        found["finite_loss"] = finite
    return found


def _pointer_bytes(target: str, records: Mapping[str, RemoteRecord]) -> bytes:
    step = checkpoint_step(target)
    content = {
        "step": step,
        "file": target,
        "checkpoints": {name: record.to_json() for name, record in sorted(records.items())},
    }
    return (json.dumps(content, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _retired(records: Mapping[str, RemoteRecord], target: str, keep_last: int | None) -> set[str]:
    """What remote retention deletes once ``target`` is committed: all but the newest
    ``keep_last`` records up to it, never ``target`` nor the newest with a finite loss."""
    if keep_last is None:
        return set()
    step = checkpoint_step(target)
    assert step is not None
    upto = sorted((r for r in records.values() if r.step <= step), key=lambda r: r.step)
    finite = next((r.name for r in reversed(upto) if r.finite), None)
    return {r.name for r in upto[:-keep_last]} - {target, finite}


class RemoteMirror:
    """Uploads committed checkpoints of one ``CheckpointManager`` to a ``RemoteStore`` on
    a background thread (module docstring: verified, pointer last, retention after).

    ``submit`` never blocks; ``flush`` waits for what is queued (each operation bounded by
    ``retry``). ``verified`` names the newest checkpoint whose upload was verified and that
    the remote pointer names.
    """

    def __init__(
        self,
        store: RemoteStore,
        manager: CheckpointManager,
        *,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.store = store
        self.manager = manager
        self.retry = retry or RetryPolicy()
        self.verified: str | None = None
        self.failures = 0
        """Uploads that failed after their retries (each one left the checkpoint local)."""
        self._records: dict[str, RemoteRecord] | None = None  # the remote pointer's, once read
        self._reported = False
        self._worker = LatestJobWorker("speedtronic-upload")

    def submit(self, path: Path) -> None:
        """Upload the committed checkpoint ``path`` when the thread is free (a checkpoint
        still waiting for it is dropped: ``path`` supersedes it)."""
        self._worker.submit(lambda: self._upload(path))

    @property
    def busy(self) -> bool:
        return self._worker.busy

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted upload is done (verified, or failed and reported)."""
        return self._worker.wait(timeout)

    def close(self, timeout: float | None = None) -> bool:
        """``flush``, then stop the thread."""
        return self._worker.close(timeout)

    def _upload(self, path: Path) -> None:
        try:
            local = _open_local(path)
        except _LocalGone:
            logger.debug("checkpoint.remote: %s is gone before its upload", path)
            return
        try:
            self._upload_open(path, local)
        except _LocalGone:
            logger.debug("checkpoint.remote: %s was deleted during its upload", path)
        except Exception as exc:  # reported; never stops training
            self._failed(local.name, exc)
        else:
            self._succeeded(local.name)
        finally:
            local.close()

    def _upload_open(self, path: Path, local: _LocalCheckpoint) -> None:
        run = _Retry(self.retry, f"uploading {local.name}")
        records = self._remote_records(run)
        previous = records.get(local.name)
        files: dict[str, RemoteFile] | None = None
        if previous is not None:
            hashes = {rel: _sha256_of(handle) for rel, handle in local.files}
            if hashes == previous.files:
                files = previous.files  # already there (a resume re-saved the same bytes)
            else:
                self._retract(local.name, records, run)
        if files is None:
            upload = self.store.upload
            files = {rel: run(partial(upload, handle, rel)) for rel, handle in local.files}
        record = RemoteRecord(
            local.name,
            self._checksum(local, files),
            files,
            _local_loss(self.manager.directory, local.name),
        )
        self._commit(record, records, run)

    def _checksum(self, local: _LocalCheckpoint, files: Mapping[str, RemoteFile]) -> str:
        """What the local pointer records for it: a file's archive checksum, a sharded
        checkpoint's manifest SHA-256."""
        if local.name.endswith(SHARDED_SUFFIX):
            return files[f"{local.name}/{MANIFEST_NAME}"].sha256
        handle = local.files[0][1]
        handle.seek(0)
        return archive_checksum(handle)

    def _remote_records(self, run: _Retry) -> dict[str, RemoteRecord]:
        """The remote pointer's records (read once; kept up to date by this mirror)."""
        if self._records is None:
            data = run(self.store.read_pointer)
            pointer, problem = (None, None) if data is None else parse_remote_pointer(data)
            if problem is not None:
                logger.warning(
                    "checkpoint.remote: ignoring %s: %s; the next upload replaces it",
                    self.store.where(POINTER_NAME),
                    problem,
                )
            self._records = dict(pointer.records) if pointer is not None else {}
        return self._records

    def _retract(self, name: str, records: dict[str, RemoteRecord], run: _Retry) -> None:
        """Rewrite the remote pointer without ``name`` before its files are replaced."""
        del records[name]
        if records:
            target = max(records.values(), key=lambda r: r.step).name
            data = _pointer_bytes(target, records)
            run(lambda: self.store.write_pointer(data))
        else:
            run(lambda: self.store.remove(POINTER_NAME))
        if self.verified == name:
            self.verified = None

    def _commit(
        self,
        record: RemoteRecord,
        records: dict[str, RemoteRecord],
        run: _Retry,
    ) -> None:
        """Point the remote pointer at ``record``, then delete what retention retires."""
        records[record.name] = record
        retired = _retired(records, record.name, self.manager.keep_last)
        kept = {
            name: r for name, r in records.items() if name not in retired and r.step <= record.step
        }
        data = _pointer_bytes(record.name, kept)
        run(lambda: self.store.write_pointer(data))
        self._records = kept
        self.verified = record.name
        for name in sorted(retired):
            run(partial(self.store.remove, name))
        # Uploads no pointer records and older than this one: cut short by a kill, or
        # retired by a run that died before deleting them.
        orphans = [
            name
            for name in run(self.store.checkpoint_names)
            if name not in kept and (checkpoint_step(name) or 0) < record.step
        ]
        for name in orphans:
            run(partial(self.store.remove, name))

    def _failed(self, name: str, exc: BaseException) -> None:
        self.failures += 1
        self._records = None  # read the remote pointer again next time
        if self._reported:
            logger.info("checkpoint.remote: upload of %s failed again: %s", name, exc)
            return
        self._reported = True
        kept = (
            f"the newest remote checkpoint is {self.verified}"
            if self.verified
            else ("no checkpoint of this run is in it yet")
        )
        logger.warning(
            "checkpoint.remote: could not upload %s to %s after %d attempt(s): %s; training "
            "goes on and the checkpoint stays local (%s). Later checkpoints are tried again; "
            "further failures are not reported until one succeeds",
            name,
            self.store.url,
            self.retry.attempts,
            describe_failure(exc),
            kept,
        )

    def _succeeded(self, name: str) -> None:
        if self._reported:
            self._reported = False
            logger.warning(
                "checkpoint.remote: uploads to %s work again (%s verified)", self.store.url, name
            )
        else:
            logger.info("checkpoint.remote: %s verified in %s", name, self.store.url)


# -- fetching on resume ----------------------------------------------------------------------


def _local_step(manager: CheckpointManager) -> int | None:
    """The step of the local commit record (else of the newest local checkpoint)."""
    step = _local_pointer(manager.pointer_path).get("step")
    if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
        return step
    return manager.newest_step()


def _local_records(manager: CheckpointManager) -> dict[str, object]:
    """The local pointer's records of checkpoints that still exist (kept when the pointer
    is pointed at a downloaded checkpoint)."""
    table = _local_pointer(manager.pointer_path).get("checkpoints")
    if not isinstance(table, dict):
        return {}
    present = {path.name for path in manager.checkpoint_paths()}
    return {name: record for name, record in table.items() if name in present}


def _warn(message: str) -> None:
    warnings.warn(f"checkpoint.remote: {message}", UserWarning, stacklevel=3)


def fetch_newer(
    store: RemoteStore, manager: CheckpointManager, *, retry: RetryPolicy | None = None
) -> Path | None:
    """Download the newest intact remote checkpoint into ``manager``'s directory when it is
    newer than what the directory holds, and point the local ``latest.json`` at it.
    Returns its local path, or ``None`` (nothing newer, or nothing usable: each problem is
    one warning, and the resume goes on from the local directory)."""
    run = _Retry(
        retry or RetryPolicy(),
        "reading the remote checkpoints",
        permanent=(FileNotFoundError, RemoteMismatch),
    )
    try:
        data = run(store.read_pointer)
    except Exception as exc:
        _warn(
            f"cannot read {store.where(POINTER_NAME)} ({describe_failure(exc)}); resuming "
            f"from the local directory {manager.directory}"
        )
        return None
    if data is None:
        logger.info("checkpoint.remote: %s holds no checkpoint yet", store.url)
        return None
    pointer, problem = parse_remote_pointer(data)
    if pointer is None:
        _warn(
            f"ignoring {store.where(POINTER_NAME)}: {problem}; resuming from the local "
            f"directory {manager.directory}"
        )
        return None
    local = _local_step(manager)
    newer = [r for r in pointer.newest_first() if local is None or r.step > local]
    for index, record in enumerate(newer):
        try:
            path = _download(store, manager, record, run)
        except _Skip as skipped:
            after = "the previous one" if index + 1 < len(newer) else "the local directory"
            _warn(f"{skipped}; resuming from {after} instead")
            continue
        except Exception as exc:
            _warn(
                f"cannot download {store.where(record.name)} ({describe_failure(exc)}); "
                f"resuming from the local directory {manager.directory}"
            )
            return None
        logger.info("checkpoint.remote: downloaded %s to %s", store.where(record.name), path)
        return path
    return None


class _Skip(Exception):
    """A remote checkpoint that cannot be used: missing or not matching its record."""


def _download(
    store: RemoteStore,
    manager: CheckpointManager,
    record: RemoteRecord,
    run: _Retry,
) -> Path:
    target = manager.directory / record.name
    manager.directory.mkdir(parents=True, exist_ok=True)
    try:
        if record.name.endswith(SHARDED_SUFFIX):
            _download_directory(store, record, target, run)
        else:
            (rel, expected), *_ = record.files.items()

            def write(handle: BinaryIO) -> None:
                store.download(rel, handle, expected)

            run(lambda: atomic_write(target, write, tag=str(os.getpid())))
    except FileNotFoundError as exc:
        raise _Skip(
            f"{store.where(POINTER_NAME)} names {record.name}, but the store has no "
            f"{first_line(exc)}"
        ) from exc
    except RemoteMismatch as exc:
        raise _Skip(f"remote checkpoint {record.name} is damaged: {exc}") from exc
    records = _local_records(manager)
    records[record.name] = record.local_record()
    atomic_json_dump(
        {"step": record.step, "file": record.name, "checkpoints": records}, manager.pointer_path
    )
    return target


def _download_directory(
    store: RemoteStore,
    record: RemoteRecord,
    target: Path,
    run: _Retry,
) -> None:
    """A sharded checkpoint: every file into a temp directory, renamed into place."""
    temp = create_temporary_directory(target, tag=str(os.getpid()))
    try:
        for rel, expected in sorted(record.files.items()):
            destination = temp / rel.rsplit("/", 1)[1]

            def write(rel: str = rel, expected: object = expected, to: Path = destination) -> None:
                assert isinstance(expected, RemoteFile)
                with open(to, "wb") as handle:
                    store.download(rel, handle, expected)
                    handle.flush()
                    os.fsync(handle.fileno())

            run(write)
        fsync_directory(temp)
        if os.path.lexists(target):  # an uncommitted local leftover at that step
            aside = target.with_name(f".{target.name}.old-{os.getpid()}-{secrets.token_hex(8)}")
            os.replace(target, aside)
            shutil.rmtree(aside, ignore_errors=True)
        os.replace(temp, target)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    fsync_directory(target.parent)
