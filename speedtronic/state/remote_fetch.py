"""Fetching on resume: the newest intact remote checkpoint into the local directory.

``fetch_newer`` runs before the local load. It reads the prefix's ownership record
(``remote_owner``) and the remote ``latest.json``; when the pointer names a newer step than
the local directory holds -- a fresh machine's empty directory -- that checkpoint is
downloaded and the local ``latest.json`` pointed at it with its checksum; the normal resume
then loads and verifies it.

Nothing local changes until the download is known to be usable. The checkpoint goes to
*staging* -- a hidden temp file or directory next to its final name, created exclusively --
where every file is checked against its upload record, and the run that saved it is read
from its training state (the ``run`` entry). Only a checkpoint of the expected run (this
run's id, or, in a directory without one, the prefix owner's) is renamed into place and
named by the local pointer; another run's is refused (``RemoteOwnerError``: exit 2 in the
CLI) with staging removed, unless ``allow_other_run`` (``--resume-from-other-run``). A
prefix owned by another run is refused before anything is read from it but its records.

A pointer naming a missing checkpoint, a file whose checksum does not match, an unreadable
pointer: each is one warning, and the resume continues from the next older remote
checkpoint, else from the local directory. A local store holding a FIFO, a device or a
link where a file is read is refused (``RemoteNotRegular``, exit 2): it was planted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

from speedtronic.state.archive import load_checkpoint_file
from speedtronic.state.atomic_io import (
    create_temporary,
    create_temporary_directory,
    fsync_directory,
)
from speedtronic.state.checkpoint import CheckpointError, CheckpointManager
from speedtronic.state.directory_swap import swap_in
from speedtronic.state.errors import first_line
from speedtronic.state.layout import POINTER_NAME
from speedtronic.state.pointer import atomic_json_dump
from speedtronic.state.remote import (
    RemotePointer,
    RemoteRecord,
    local_pointer,
    parse_remote_pointer,
    read_remote_pointer,
)
from speedtronic.state.remote_owner import RemoteOwner, RemoteOwnerError, read_owner
from speedtronic.state.remote_store import (
    RemoteMismatch,
    RemoteNotRegular,
    RemoteStore,
    Retry,
    RetryPolicy,
    describe_failure,
)
from speedtronic.state.run_identity import OTHER_RUN_FLAG, saved_run
from speedtronic.state.sharded_checkpoint import SHARDED_SUFFIX, STATE_NAME

__all__ = ["fetch_newer"]

logger = logging.getLogger("speedtronic.checkpoint")


@dataclass(frozen=True)
class _Fetched:
    """What ``fetch_newer`` did: the checkpoint it brought into the directory (``None``:
    none), and the id of the run the prefix belongs to (``None``: no ownership record)."""

    path: Path | None = None
    owner: str | None = None


def _local_step(manager: CheckpointManager) -> int | None:
    """The step of the local commit record (else of the newest local checkpoint)."""
    step = local_pointer(manager.pointer_path).get("step")
    if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
        return step
    return manager.newest_step()


def _local_records(manager: CheckpointManager) -> dict[str, object]:
    """The local pointer's records of checkpoints that still exist (kept when the pointer
    is pointed at a downloaded checkpoint)."""
    table = local_pointer(manager.pointer_path).get("checkpoints")
    if not isinstance(table, dict):
        return {}
    present = {path.name for path in manager.checkpoint_paths()}
    return {name: record for name, record in table.items() if name in present}


def _warn(message: str) -> None:
    warnings.warn(f"checkpoint.remote: {message}", UserWarning, stacklevel=3)


@dataclass(frozen=True)
class _Expected:
    """Whose checkpoints this resume may take: ``run_id`` (``None``: anyone's)."""

    run_id: str | None
    ours: bool  # this run's own id (else the prefix owner's, for a directory without one)

    def refuse(self, store: RemoteStore, name: str, theirs: str) -> RemoteOwnerError:
        whose = "this run's (run id" if self.ours else "the prefix owner's (run id"
        return RemoteOwnerError(
            f"cannot resume from {store.where(name)}: it was written by another run (run "
            f"id {theirs}), not {whose} {self.run_id}); nothing was changed locally. Pass "
            f"{OTHER_RUN_FLAG} to continue from it anyway, or give this run a "
            "checkpoint.remote of its own"
        )


def fetch_newer(
    store: RemoteStore,
    manager: CheckpointManager,
    *,
    retry: RetryPolicy | None = None,
    run_id: str | None = None,
    allow_other_run: bool = False,
) -> _Fetched:
    """Download the newest intact remote checkpoint into ``manager``'s directory when it is
    newer than what the directory holds, and point the local ``latest.json`` at it
    (module docstring). ``run_id``: this run's id (``None``: a run directory without one).
    Each unusable checkpoint is one warning and the resume goes on from the next older one
    or the local directory; another run's prefix or checkpoint is ``RemoteOwnerError``
    unless ``allow_other_run``; a planted non-file is ``RemoteNotRegular``."""
    run = Retry(
        retry or RetryPolicy(),
        "reading the remote checkpoints",
        (FileNotFoundError, RemoteMismatch, RemoteOwnerError),
    )
    try:
        owner = read_owner(store, run)
        data = run(lambda: read_remote_pointer(store))
    except (RemoteOwnerError, RemoteNotRegular):
        raise
    except Exception as exc:
        _warn(
            f"cannot read {store.where(POINTER_NAME)} ({describe_failure(exc)}); resuming "
            f"from the local directory {manager.directory}"
        )
        return _Fetched()
    expected = _expected(store, owner, run_id, allow_other_run)
    owner_id = None if owner is None else owner.run_id
    if data is None:
        logger.info("checkpoint.remote: %s holds no checkpoint yet", store.url)
        return _Fetched(owner=owner_id)
    pointer, problem = parse_remote_pointer(data)
    if pointer is None:
        _warn(
            f"ignoring {store.where(POINTER_NAME)}: {problem}; resuming from the local "
            f"directory {manager.directory}"
        )
        return _Fetched(owner=owner_id)
    return _Fetched(_fetch_from(store, manager, pointer, expected, run), owner_id)


def _expected(
    store: RemoteStore, owner: RemoteOwner | None, run_id: str | None, allow_other_run: bool
) -> _Expected:
    """Whose checkpoints may be fetched; ``RemoteOwnerError`` when the prefix is another
    run's (nothing read from it yet but its records)."""
    if allow_other_run:
        return _Expected(None, ours=False)
    if run_id is None:  # a new run directory: the prefix's owner is the run it continues
        return _Expected(None if owner is None else owner.run_id, ours=False)
    if owner is not None and owner.run_id != run_id:
        raise RemoteOwnerError(
            f"cannot resume from checkpoint.remote {store.url}: it belongs to another run "
            f"({owner.describe()}), not to this one (run id {run_id}); nothing was "
            f"changed locally. Pass {OTHER_RUN_FLAG} to take it over, or give this run a "
            "checkpoint.remote of its own"
        )
    return _Expected(run_id, ours=True)


def _fetch_from(
    store: RemoteStore,
    manager: CheckpointManager,
    pointer: RemotePointer,
    expected: _Expected,
    run: Retry,
) -> Path | None:
    local = _local_step(manager)
    newer = [r for r in pointer.newest_first() if local is None or r.step > local]
    for index, record in enumerate(newer):
        theirs = record.run_id
        if expected.run_id is not None and theirs is not None and theirs != expected.run_id:
            raise expected.refuse(store, record.name, theirs)  # before any download
        try:
            path = _download(store, manager, record, expected, run)
        except _Skip as skipped:
            after = "the previous one" if index + 1 < len(newer) else "the local directory"
            _warn(f"{skipped}; resuming from {after} instead")
            continue
        except (RemoteOwnerError, RemoteNotRegular):
            raise
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
    expected: _Expected,
    run: Retry,
) -> Path:
    """Stage ``record``, check whose it is, then rename it into place and point the local
    ``latest.json`` at it; staging is removed on any failure."""
    target = manager.directory / record.name
    created = not manager.directory.exists()  # removed again when the download is refused
    manager.directory.mkdir(parents=True, exist_ok=True)
    sharded = record.name.endswith(SHARDED_SUFFIX)
    try:
        staging = (
            create_temporary_directory(target, tag=str(os.getpid()))
            if sharded
            else _staging_file(target)
        )
    except BaseException:
        if created:
            _remove_empty(manager.directory)
        raise
    try:
        try:
            _stage(store, record, staging, run)
        except FileNotFoundError as exc:
            raise _Skip(
                f"{store.where(POINTER_NAME)} names {record.name}, but the store has no "
                f"{first_line(exc)}"
            ) from exc
        except RemoteMismatch as exc:
            raise _Skip(f"remote checkpoint {record.name} is damaged: {exc}") from exc
        _check_saved_by(store, record, staging, expected)
        _commit(staging, target)
    except BaseException:
        _remove(staging)
        if created:
            _remove_empty(manager.directory)
        raise
    records = _local_records(manager)
    records[record.name] = record.local_record()
    atomic_json_dump(
        {"step": record.step, "file": record.name, "checkpoints": records}, manager.pointer_path
    )
    return target


def _staging_file(target: Path) -> Path:
    temporary, handle = create_temporary(target, tag=str(os.getpid()))
    handle.close()
    return temporary


def _stage(store: RemoteStore, record: RemoteRecord, staging: Path, run: Retry) -> None:
    """Every file of ``record`` into ``staging`` (a file, or a directory for a ``.dcp``),
    each checked against its upload record, flushed to disk."""
    for rel, expected in sorted(record.files.items()):
        destination = staging / rel.rsplit("/", 1)[1] if staging.is_dir() else staging

        def write(rel: str = rel, expected: object = expected, to: Path = destination) -> None:
            with open(to, "wb") as handle:  # the staging file, or new inside staging
                store.download(rel, handle, expected)  # type: ignore[arg-type]  # RemoteFile
                handle.flush()
                os.fsync(handle.fileno())

        run(write)
    if staging.is_dir():
        fsync_directory(staging)


def _check_saved_by(
    store: RemoteStore, record: RemoteRecord, staging: Path, expected: _Expected
) -> None:
    """``RemoteOwnerError`` when the staged checkpoint's training state names another run
    than ``expected`` (its record may claim anything: the state is what a resume takes)."""
    if expected.run_id is None:
        return
    state_file = staging / STATE_NAME if staging.is_dir() else staging
    try:
        state = load_checkpoint_file(
            state_file, checksum=None if staging.is_dir() else record.checksum
        )
    except CheckpointError as exc:
        raise _Skip(f"remote checkpoint {record.name} cannot be read: {first_line(exc)}") from exc
    theirs = saved_run(state)[0]
    if theirs is not None and theirs != expected.run_id:
        raise expected.refuse(store, record.name, theirs)


def _commit(staging: Path, target: Path) -> None:
    """Rename ``staging`` over ``target``. A directory (a sharded checkpoint) is swapped in
    (``directory_swap.swap_in``): an uncommitted local leftover at that step is moved aside,
    put back if the rename fails, and removed once the download is in place."""
    if staging.is_dir():
        swap_in(staging, target, what="checkpoint", any_entry=True)
    else:
        os.replace(staging, target)
    fsync_directory(target.parent)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _remove_empty(directory: Path) -> None:
    """Remove ``directory`` if it is empty (a checkpoint directory made for a download that
    was then refused)."""
    with contextlib.suppress(OSError):
        directory.rmdir()
