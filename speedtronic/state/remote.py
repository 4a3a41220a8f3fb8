"""Object-store copies of committed checkpoints: the remote pointer and the upload mirror.

``checkpoint.remote: s3://bucket/run1`` (any fsspec URL: ``gs://``, ``az://``, ``file://``,
``memory://``, ...) mirrors the checkpoint directory into the store::

    s3://bucket/run1/
        owner.json                  which run the prefix belongs to (``remote_owner``)
        latest.json                 the remote commit record, written last (below)
        step_000000000010.pt
        step_000000000020.dcp/manifest.json, state.pt, .metadata, __0_0.distcp, ...

The store's file operations are ``remote_store``; fetching on resume is ``remote_fetch``.

Uploading (``RemoteMirror``, one background thread: ``speedtronic.util.worker.BackgroundWorker``
where a newer job replaces one still waiting).
The mirror first claims the prefix for its run (``remote_owner.claim``; a prefix of another
run is ``refusal``, which the checkpoint callback raises). After the local commit (the
local ``latest.json`` names the checkpoint) its path is handed to the mirror, which never
blocks the training thread; a checkpoint still waiting when a newer one commits is dropped
for it. One upload:

1. every file of the checkpoint is streamed to the store (its SHA-256 computed on the way),
   then verified: its size and SHA-256 read back from the store must match;
2. only then -- and only while ``owner.json`` still names this run (read before the files
   are uploaded and again here) -- is the remote
   ``latest.json`` rewritten to name it, with a record per kept remote checkpoint: the
   local pointer's checksum (what a local load verifies), the loss, every file's size and
   SHA-256, and the id of the run that uploaded it -- a reader never finds a pointer to an
   incomplete upload;
3. then retention, the local rules applied to this run's remote records: all but the
   newest ``keep_last`` are deleted (never the one just uploaded, nor the newest with a
   finite loss) -- after the pointer stopped recording them, and so only once their
   replacement is verified -- and so are uploads that no pointer records (cut short by a
   kill) in the prefix this run owns. Records of another run (a prefix taken over with
   ``--resume-from-other-run``) are kept in the pointer and never deleted.

Re-uploading a step the remote pointer records with other content first rewrites the
pointer without it (another run's checkpoint of that step is not replaced: that upload
fails). Every store operation is retried with jittered exponential backoff (``tenacity``;
``RetryPolicy``); an upload that still fails is reported once (one warning until an upload
succeeds again) and training goes on -- the checkpoint stays local and the next one is
tried. Nothing remote is deleted on a failed upload.

``fsspec`` (with ``s3fs`` for ``s3://``) and ``tenacity`` are the ``remote`` extra; they are
imported only when a store is opened (``RemoteError`` naming the pip line when missing).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import BinaryIO

from speedtronic.state.archive import archive_checksum
from speedtronic.state.checkpoint import CheckpointManager
from speedtronic.state.layout import POINTER_NAME, checkpoint_step
from speedtronic.state.pointer import MAX_POINTER_BYTES, decode_pointer_bytes
from speedtronic.state.remote_owner import RemoteOwnerError, check, claim, this_run
from speedtronic.state.remote_store import (
    RemoteError,
    RemoteFile,
    RemoteStore,
    Retry,
    RetryPolicy,
    describe_failure,
)
from speedtronic.state.run_identity import is_run_id
from speedtronic.state.sharded_checkpoint import MANIFEST_NAME, SHARDED_SUFFIX
from speedtronic.util.worker import BackgroundWorker, run_job

__all__ = [
    "RemoteMirror",
    "RemotePointer",
    "RemoteRecord",
    "local_pointer",
    "parse_remote_pointer",
    "read_remote_pointer",
]

logger = logging.getLogger("speedtronic.checkpoint")

_CHUNK = 8 * 1024 * 1024
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_SHARD_FILE = r"(?:state\.pt|\.metadata|manifest\.json|__\d{1,9}_\d{1,9}\.distcp)"
_REMOTE_FILE = re.compile(rf"(step_\d{{12}}\.pt)|(step_\d{{12}}\.dcp)/{_SHARD_FILE}")


@dataclass(frozen=True)
class RemoteRecord:
    """A verified remote checkpoint: ``name`` (``step_...pt`` or ``.dcp``), the checksum
    the local pointer records for it (``None``: unknown), its loss entries, its files
    (path under the remote root -> size and SHA-256) and the id of the run that uploaded
    it (``None``: a run without an id, or an upload from before run ids were recorded)."""

    name: str
    checksum: str | None
    files: dict[str, RemoteFile]
    loss: dict[str, object] = field(default_factory=dict)
    run_id: str | None = None

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
        if self.run_id is not None:
            record["run_id"] = self.run_id
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
    run_id = value.get("run_id")
    if run_id is not None and not is_run_id(run_id):
        return None, f"the record of {name!r} has an invalid run_id"
    loss = {key: value[key] for key in ("loss", "finite_loss") if key in value}
    checksum = checksum if isinstance(checksum, str) else None
    owner = run_id if isinstance(run_id, str) else None
    return RemoteRecord(name, checksum, parsed, loss, owner), ""


def read_remote_pointer(store: RemoteStore) -> bytes | None:
    """The remote ``latest.json`` (at most a byte more than a pointer may be), or ``None``
    when there is none."""
    return store.read_small(POINTER_NAME, MAX_POINTER_BYTES)


# -- uploading -------------------------------------------------------------------------------


@dataclass
class _LocalGone(Exception):
    """The local checkpoint being uploaded was deleted meanwhile (a newer one replaced it)."""


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


def local_pointer(path: Path) -> dict[str, object]:
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
    table = local_pointer(directory / POINTER_NAME).get("checkpoints")
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


def _retired(
    records: Mapping[str, RemoteRecord], target: str, keep_last: int | None, run_id: str | None
) -> set[str]:
    """What remote retention deletes once ``target`` is committed: all but the newest
    ``keep_last`` of this run's records up to it, never ``target`` nor the newest with a
    finite loss -- and never a record of another run (``run_id``: this run's id)."""
    if keep_last is None:
        return set()
    step = checkpoint_step(target)
    assert step is not None
    ours = (r for r in records.values() if r.step <= step and r.run_id == run_id)
    upto = sorted(ours, key=lambda r: r.step)
    finite = next((r.name for r in reversed(upto) if r.finite), None)
    return {r.name for r in upto[:-keep_last]} - {target, finite}


class RemoteMirror:
    """Uploads committed checkpoints of one ``CheckpointManager`` to a ``RemoteStore`` on
    a background thread (module docstring: verified, pointer last, retention after).

    ``start`` claims the prefix for run ``run_id`` in the background (``remote_owner``);
    ``submit`` never blocks; ``flush`` waits for what is queued (each operation bounded by
    ``retry``). ``verified`` names the newest checkpoint whose upload was verified and that
    the remote pointer names; ``refusal`` is the ``RemoteOwnerError`` that stopped every
    upload (the prefix is another run's), for the caller to raise; ``activity`` says what
    the thread is doing now (for a wait that takes long).
    """

    def __init__(
        self,
        store: RemoteStore,
        manager: CheckpointManager,
        *,
        retry: RetryPolicy | None = None,
        run_id: str | None = None,
        output_dir: str | None = None,
        take_over: bool = False,
    ) -> None:
        self.store = store
        self.manager = manager
        self.retry = retry or RetryPolicy()
        self.run_id = run_id
        self.verified: str | None = None
        self.failures = 0
        """Uploads that failed after their retries (each one left the checkpoint local)."""
        self.refusal: RemoteOwnerError | None = None
        self.activity: str | None = None
        self.submitted: str | None = None
        """The newest checkpoint handed to ``submit`` (what a final wait waits for)."""
        self._output_dir = output_dir
        self._take_over = take_over
        self._owned = run_id is None  # a run without an id claims nothing
        self._records: dict[str, RemoteRecord] | None = None  # the remote pointer's, once read
        self._reported = False
        self._worker: BackgroundWorker[Callable[[], None]] = BackgroundWorker(
            "speedtronic-upload", run_job, max_pending=1, when_full="replace"
        )

    def start(self) -> None:
        """Claim the prefix now, in the background (an upload submitted before the claim
        ran replaces it, and claims first itself)."""
        if not self._owned:
            self._worker.submit(self._claim_job)

    def submit(self, path: Path) -> None:
        """Upload the committed checkpoint ``path`` when the thread is free (a checkpoint
        still waiting for it is dropped: ``path`` supersedes it)."""
        self.submitted = path.name
        self._worker.submit(lambda: self._upload(path))

    @property
    def busy(self) -> bool:
        return self._worker.busy

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted upload is done (verified, or failed and reported);
        ``False`` when ``timeout`` seconds passed first."""
        return self._worker.drain(timeout)

    def close(self, timeout: float | None = None) -> bool:
        """``flush``, then stop the thread (a job still running after ``timeout`` is
        abandoned: the thread is a daemon)."""
        return self._worker.close(timeout)

    def _claim_job(self) -> None:
        try:
            self._ensure_owner(Retry(self.retry, "claiming the prefix", (RemoteOwnerError,)))
        except RemoteOwnerError as exc:
            self.refusal = exc
        except Exception as exc:  # the store is down: the first upload claims it again
            logger.warning(
                "checkpoint.remote: cannot check which run %s belongs to (%s); uploads wait "
                "until it can be checked",
                self.store.url,
                describe_failure(exc),
            )
        finally:
            self.activity = None

    def _ensure_owner(self, run: Retry) -> None:
        if self._owned:
            return
        assert self.run_id is not None
        self.activity = f"checking who owns {self.store.url}"
        claim(
            self.store,
            this_run(self.run_id, self._output_dir),
            run,
            take_over=self._take_over,
        )
        self._owned = True

    def _upload(self, path: Path) -> None:
        if self.refusal is not None:
            return  # the prefix is another run's: nothing more goes there
        try:
            local = _open_local(path)
        except _LocalGone:
            logger.debug("checkpoint.remote: %s is gone before its upload", path)
            return
        self.activity = f"uploading {local.name} to {self.store.url}"
        try:
            self._upload_open(path, local)
        except _LocalGone:
            logger.debug("checkpoint.remote: %s was deleted during its upload", path)
        except RemoteOwnerError as exc:
            self.refusal = exc
        except Exception as exc:  # reported; never stops training
            self._failed(local.name, exc)
        else:
            self._succeeded(local.name)
        finally:
            self.activity = None
            local.close()

    def _upload_open(self, path: Path, local: _LocalCheckpoint) -> None:
        run = Retry(self.retry, f"uploading {local.name}", (_LocalGone, RemoteOwnerError))
        if self._owned and self.run_id is not None:
            check(self.store, self.run_id, run)  # not taken over since: upload nothing
        self._ensure_owner(run)
        records = self._remote_records(run)
        previous = records.get(local.name)
        files: dict[str, RemoteFile] | None = None
        if previous is not None:
            hashes = {rel: _sha256_of(handle) for rel, handle in local.files}
            if hashes == previous.files:
                files = previous.files  # already there (a resume re-saved the same bytes)
            elif previous.run_id != self.run_id:
                raise RemoteError(
                    f"{self.store.where(local.name)} is another run's checkpoint (run id "
                    f"{previous.run_id}); it is not replaced"
                )
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
            self.run_id,
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

    def _remote_records(self, run: Retry) -> dict[str, RemoteRecord]:
        """The remote pointer's records (read once; kept up to date by this mirror)."""
        if self._records is None:
            data = run(partial(read_remote_pointer, self.store))
            pointer, problem = (None, None) if data is None else parse_remote_pointer(data)
            if problem is not None:
                logger.warning(
                    "checkpoint.remote: ignoring %s: %s; the next upload replaces it",
                    self.store.where(POINTER_NAME),
                    problem,
                )
            self._records = dict(pointer.records) if pointer is not None else {}
        return self._records

    def _write_pointer(self, records: Mapping[str, RemoteRecord], target: str, run: Retry) -> None:
        """Rewrite the remote pointer, once the prefix is still this run's (``check``)."""
        if self.run_id is not None:
            check(self.store, self.run_id, run)
        data = _pointer_bytes(target, records)
        run(lambda: self.store.write_small(POINTER_NAME, data))

    def _retract(self, name: str, records: dict[str, RemoteRecord], run: Retry) -> None:
        """Rewrite the remote pointer without ``name`` before its files are replaced."""
        del records[name]
        if records:
            ours = [r for r in records.values() if r.run_id == self.run_id]
            newest = max(ours or records.values(), key=lambda r: r.step)
            self._write_pointer(records, newest.name, run)
        else:
            if self.run_id is not None:
                check(self.store, self.run_id, run)
            run(lambda: self.store.remove(POINTER_NAME))
        if self.verified == name:
            self.verified = None

    def _commit(
        self,
        record: RemoteRecord,
        records: dict[str, RemoteRecord],
        run: Retry,
    ) -> None:
        """Point the remote pointer at ``record``, then delete what retention retires --
        only ever this run's own checkpoints; another run's records are kept as they are."""
        records[record.name] = record
        retired = _retired(records, record.name, self.manager.keep_last, self.run_id)
        kept = {
            name: r
            for name, r in records.items()
            if name not in retired and (r.step <= record.step or r.run_id != self.run_id)
        }
        self._write_pointer(kept, record.name, run)
        self._records = kept
        self.verified = record.name
        for name in sorted(retired):
            run(partial(self.store.remove, name))
        # Uploads no pointer records and older than this one: cut short by a kill (the
        # prefix is this run's, checked just now: no other run uploads there).
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
