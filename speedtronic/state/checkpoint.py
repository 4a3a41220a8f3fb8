"""The checkpoint manager: names, writes, finds, loads and prunes one directory's checkpoints.

A save writes the checkpoint (``speedtronic.state.archive``, or a sharded directory:
``speedtronic.state.sharded_checkpoint``), then ``latest.json`` (``speedtronic.state.pointer``)
-- without the records of the checkpoints retention is about to delete -- and only then
deletes those. A process killed at any moment therefore leaves the previous checkpoint and
pointer intact, and the pointer never records a file that is gone. Every file goes through
the directory's atomic writer (``speedtronic.state.layout``: exclusive temp file, fsync,
rename, directory fsync).

Retention (``keep_last``) keeps the newest checkpoints up to the one the pointer names, and
never deletes that one, the best one (``best.json``) or the newest whose loss was finite.
Loading verifies each checkpoint against the checksum its pointer record holds and falls
back past a damaged one to an older one (``load_latest_checkpoint``); a checkpoint holding
pickled objects is refused, never stepped over (``speedtronic.state.safe_load``).

Sharded checkpoints (``parallel.strategy: fsdp``) follow the same rules: the directory is
complete before it gets its final name, the pointer records the SHA-256 of its manifest
(which holds every file's), ``keep_last`` counts it like a file, and one that is incomplete
or damaged -- a rank's shard missing, say -- is skipped for an older one. Their ``save`` is a
collective: every rank calls it, rank 0 commits.

This module is also the public import path of the storage layer's names (re-exported
below, and again by the 2.0 path ``speedtronic.checkpoint``). *When* to save is the
checkpoint callback's business (``callbacks/speedtronic_callbacks/checkpoint.py``), saving
on a background thread is ``speedtronic.state.checkpoint_async``, and loading into a
trainer is ``speedtronic.state.resume``.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from speedtronic.state.archive import archive_checksum, atomic_torch_save, load_checkpoint_file
from speedtronic.state.errors import (
    CheckpointError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    write_error,
)
from speedtronic.state.layout import (
    BEST_POINTER_NAME,
    POINTER_NAME,
    SHARDED_SUFFIX,
    PathLike,
    checkpoint_name,
    checkpoint_step,
    is_checkpoint_entry,
    is_inside,
    remove_stale_temp_files,
    write_atomically,
)

# Retention's deletions go through this module's name, so that a crash between the pointer
# and a deletion can be simulated by replacing it (tests/test_hardening.py).
from speedtronic.state.layout import remove as _remove
from speedtronic.state.pointer import (
    BestCheckpoint,
    Pointer,
    atomic_json_dump,
    loss_record,
    parse_pointer,
    read_best,
    read_pointer,
    recorded_checksum,
    validate_pointer,
    write_best,
    write_pointer,
)
from speedtronic.state.rng import capture_rng_state, restore_rng_state
from speedtronic.state.safe_load import plain_state
from speedtronic.state.sharded_checkpoint import (
    agree_corrupt,
    copy_sharded,
    is_sharded_state,
    read_sharded_state,
    verify_sharded,
    write_sharded,
)
from speedtronic.state.signals import requeue_exit_code, signal_stop_reason

__all__ = [
    "BEST_POINTER_NAME",
    "POINTER_NAME",
    "BestCheckpoint",
    "CheckpointError",
    "CheckpointManager",
    "CorruptCheckpointError",
    "LoadedCheckpoint",
    "Pointer",
    "SkippedCheckpoint",
    "UnsafeCheckpointError",
    "archive_checksum",
    "atomic_json_dump",
    "atomic_torch_save",
    "capture_rng_state",
    "checkpoint_step",
    "load_checkpoint_file",
    "parse_pointer",
    "plain_state",
    "requeue_exit_code",
    "restore_rng_state",
    "signal_stop_reason",
]


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A checkpoint read from disk: where it came from and its state; ``skipped``: the newer
    ones passed over because they could not be read, newest first."""

    path: Path
    step: int
    state: dict[str, object]
    skipped: tuple[SkippedCheckpoint, ...] = ()


@dataclass(frozen=True)
class SkippedCheckpoint:
    """A checkpoint a load fell back past: ``reason`` is the error that made it unreadable."""

    path: Path
    reason: str


# -- retention ----------------------------------------------------------------------------


def _newest_with_finite_loss(
    paths: list[Path], records: Mapping[str, Mapping[str, object]]
) -> Path | None:
    """The newest checkpoint the pointer records, and not with a non-finite loss (a record
    without a loss counts as finite). A file the pointer has no record of does not count:
    it may be one whose record retention dropped just before deleting it (a crash in
    between leaves it), and nothing says its loss was finite."""
    for path in reversed(paths):
        record = records.get(path.name)
        if record is not None and record.get("finite_loss") is not False:
            return path
    return None


# -- the manager ------------------------------------------------------------------------------


class CheckpointManager:
    """Names, writes, finds, loads and prunes the checkpoints of one directory.

    ``save`` writes unconditionally; ``should_save`` tells a caller when the interval is due.
    ``keep_last=None`` keeps every checkpoint.
    """

    def __init__(
        self,
        directory: PathLike,
        *,
        every_steps: int = 500,
        keep_last: int | None = 3,
        enabled: bool = True,
    ) -> None:
        if isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps <= 0:
            raise ValueError(f"every_steps must be a positive integer, got {every_steps!r}")
        if keep_last is not None and (isinstance(keep_last, bool) or keep_last <= 0):
            raise ValueError(f"keep_last must be positive or null, got {keep_last!r}")
        self.directory = Path(directory)
        self.every_steps = every_steps
        self.keep_last = keep_last
        self.enabled = enabled
        self._noted_losses: dict[int, float] = {}
        self._noted_best: dict[int, tuple[str, str, float]] = {}

    def __repr__(self) -> str:
        return (
            f"CheckpointManager({str(self.directory)!r}, every_steps={self.every_steps}, "
            f"keep_last={self.keep_last}, enabled={self.enabled})"
        )

    @property
    def pointer_path(self) -> Path:
        return self.directory / POINTER_NAME

    @property
    def best_pointer_path(self) -> Path:
        return self.directory / BEST_POINTER_NAME

    def should_save(self, step: int) -> bool:
        """True when checkpointing is enabled and ``step`` is a positive interval multiple."""
        return self.enabled and step > 0 and step % self.every_steps == 0

    def path_for(self, step: int) -> Path:
        """``<directory>/step_<step, 12 digits>.pt``."""
        return self.directory / checkpoint_name(step)

    def has_checkpoint(self, step: int) -> bool:
        """Whether a checkpoint of ``step`` (a file or a sharded directory) is present."""
        path = self.path_for(step)
        return path.is_file() or path.with_suffix(SHARDED_SUFFIX).is_dir()

    # -- writing ----------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, object], *, loss: float | None = None) -> Path:
        """Write the checkpoint of ``step``, then point ``latest.json`` at it, then prune.

        ``state`` goes through ``plain_state``: ``CheckpointError`` (nothing is written) when
        it holds an object that a ``weights_only`` load would refuse. A sharded state
        (``parallel.strategy: fsdp``) is written as a ``step_<digits>.dcp`` directory by every
        rank: call ``save`` on every rank then; rank 0 commits. ``loss`` (the training
        loss at ``step``; else what ``note_loss`` noted for it) is recorded in the pointer's
        record of the file; a non-finite one is recorded as such, and retention keeps the
        newest checkpoint whose loss was finite.
        """
        noted = self._noted_losses.pop(step, None)
        if is_sharded_state(state):
            path = self.path_for(step).with_suffix(SHARDED_SUFFIX)
            checksum = write_sharded(path, state)  # a collective; rank 0 commits
            if not checksum:
                return path
        else:
            path = self.path_for(step)
            checksum = atomic_torch_save(plain_state(state), path)
        records = self._surviving_records(exclude=path.name)
        records[path.name] = {"sha256": checksum, **loss_record(noted if loss is None else loss)}
        best = self._noted_best.pop(step, None)
        best_path = path if best is not None else self.best_path(warn=False)
        # The records of what retention is about to delete are left out: the pointer never
        # records a file that is gone (it is written first, then the files are deleted).
        for retired in self._retired(path, records, best_path):
            records.pop(retired.name, None)
        write_pointer(self.directory, path, records)
        if best is not None:
            write_best(self.directory, path, records[path.name], best)
        self.prune()
        return path

    def note_best(self, step: int, monitor: str, mode: str, value: float) -> None:
        """Note that the coming ``save`` of ``step`` is the best checkpoint by ``monitor``
        (``value``, ``mode`` min or max): ``best.json`` is rewritten to name it once the
        checkpoint and ``latest.json`` are on disk."""
        if not math.isfinite(value):
            raise ValueError(f"a best value must be finite, got {value!r}")
        self._noted_best[step] = (monitor, mode, value)

    def _surviving_records(self, *, exclude: str) -> dict[str, dict[str, object]]:
        """The pointer's per-file records of checkpoints that still exist (carried into the
        next pointer, so older checkpoints stay verifiable as fall-backs)."""
        pointer = self._read_pointer(warn=False)
        return {
            name: dict(record)
            for name, record in pointer.records.items()
            if name != exclude and is_checkpoint_entry(self.directory / name)
        }

    def note_loss(self, step: int, loss: float | None) -> None:
        """Note the training loss of ``step`` for its coming ``save`` (which may run on a
        writer thread): the checkpoint callback's way to record it without changing how
        ``save`` is called."""
        if loss is not None:
            self._noted_losses[step] = loss

    def prune(self) -> list[Path]:
        """Delete all but the newest ``keep_last`` checkpoints (never the one ``latest.json``
        names) and temp files left by processes that no longer run. Returns what was deleted.

        Crash-safe order: when ``latest.json`` records a checkpoint about to be deleted, it
        is rewritten without that record first, and only then is the file deleted. A crash
        in between leaves a file the pointer no longer records (the next prune deletes it),
        never a record of a file that is gone."""
        removed = remove_stale_temp_files(self.directory)
        if self.keep_last is None:
            return removed
        pointer = self._read_pointer(warn=False)
        retired = self._retired(pointer.target, pointer.records, self.best_path(warn=False))
        names = {path.name for path in retired}
        if pointer.target is not None and names & set(pointer.records):
            kept = {n: r for n, r in pointer.records.items() if n not in names}
            write_pointer(self.directory, pointer.target, kept)
        for path in retired:
            with contextlib.suppress(FileNotFoundError):
                _remove(path)
                removed.append(path)
        return removed

    def _retired(
        self,
        target: Path | None,
        records: Mapping[str, Mapping[str, object]],
        best: Path | None,
    ) -> list[Path]:
        """The checkpoints retention deletes when ``target`` is the committed one (with
        ``records``) and ``best`` the best: all but the newest ``keep_last`` up to
        ``target``, except ``target``, ``best`` and the newest with a finite loss."""
        if self.keep_last is None:
            return []
        paths = self.checkpoint_paths()
        if target in paths:
            # Files newer than the commit record were never committed (a killed save, or
            # another run's): they neither take a keep_last slot nor get deleted here.
            paths = paths[: paths.index(target) + 1]
        protected = {target, _newest_with_finite_loss(paths, records), best}
        return [path for path in paths[: -self.keep_last] if path not in protected]

    def copy_to(self, destination: PathLike) -> Path:
        """Copy the latest checkpoint to ``destination`` (a file path, or an existing
        directory to copy into), atomically. ``CheckpointError`` when there is none."""
        source = self.latest_path()
        if source is None:
            raise CheckpointError(f"no checkpoint to copy in {self.directory}")
        target = Path(destination)
        if target.is_dir():
            target = target / source.name
        if source.is_dir():  # a sharded checkpoint: copied whole, then renamed into place
            try:
                copy_sharded(source, target)
            except OSError as exc:
                raise write_error(target, exc) from exc
            return target

        def copy(handle: BinaryIO) -> None:
            with open(source, "rb") as src:
                shutil.copyfileobj(src, handle, length=16 * 1024 * 1024)

        write_atomically(target, copy)
        return target

    # -- finding ----------------------------------------------------------------------

    def checkpoint_paths(self) -> list[Path]:
        """Every ``step_<digits>.pt`` file (and ``step_<digits>.dcp`` directory) directly in
        the directory, oldest step first."""
        if not self.directory.is_dir():
            return []
        found: list[tuple[int, Path]] = []
        for entry in self.directory.iterdir():
            step = checkpoint_step(entry.name)
            if step is not None and is_checkpoint_entry(entry) and is_inside(entry, self.directory):
                found.append((step, entry))
        return [path for _, path in sorted(found)]

    _checkpoint_paths = checkpoint_paths  # the original's private name

    def newest_step(self) -> int | None:
        """The highest step of any checkpoint file present (complete or not named by the
        pointer), or ``None``."""
        paths = self.checkpoint_paths()
        return checkpoint_step(paths[-1].name) if paths else None

    def _pointer_target(self, *, warn: bool) -> Path | None:
        """The checkpoint ``latest.json`` names, after validation; ``None`` (with a warning
        when ``warn``) when the pointer is absent, malformed, tampered or dangling."""
        return self._read_pointer(warn=warn).target

    def _read_pointer(self, *, warn: bool) -> Pointer:
        """``latest.json``, validated; an empty ``Pointer`` (with a warning when ``warn``)
        when it is absent, malformed, tampered or dangling."""
        return read_pointer(self.directory, warn=warn)

    def read_best(self, *, warn: bool = True) -> BestCheckpoint | None:
        """``best.json``, validated like ``latest.json`` (a file name inside the directory
        that exists, a matching step) plus its ``monitor``, ``mode`` and finite ``value``;
        ``None`` (with a warning when ``warn``) when it is absent or not valid."""
        return read_best(self.directory, warn=warn)

    def best_path(self, *, warn: bool = True) -> Path | None:
        """The checkpoint ``best.json`` names (validated), or ``None``."""
        best = self.read_best(warn=warn)
        return best.path if best is not None else None

    def _validate_pointer(self, content: object) -> tuple[Pointer, str | None]:
        """Decoded ``latest.json`` content of this directory, validated (``parse_pointer``'s
        ``validate``)."""
        return validate_pointer(self.directory, content)

    def latest_path(self) -> Path | None:
        """The checkpoint to resume from: the one ``latest.json`` names when the pointer is
        valid, else the highest-step checkpoint file; ``None`` when there is none."""
        target = self._pointer_target(warn=True)
        if target is not None:
            return target
        paths = self.checkpoint_paths()
        return paths[-1] if paths else None

    def _resume_candidates(self, target: Path | None) -> list[Path]:
        newest_first = list(reversed(self.checkpoint_paths()))
        if target is None:
            return newest_first
        # Files newer than the pointer were never committed (the process died between the
        # rename and the pointer update); older ones are fall-backs for a damaged target.
        target_step = checkpoint_step(target.name)
        assert target_step is not None
        older = [p for p in newest_first if (checkpoint_step(p.name) or 0) < target_step]
        return [target, *older]

    # -- loading ----------------------------------------------------------------------

    def load(self, path: PathLike) -> dict[str, object]:
        """Load one checkpoint file (``weights_only=True``, onto the CPU), verified against
        the checksum the pointer recorded for it, if any."""
        path = Path(path)
        records = self._read_pointer(warn=False).records if path.parent == self.directory else {}
        checksum = recorded_checksum(records, path.name)
        if path.is_dir():
            verify_sharded(path, checksum)
            return read_sharded_state(path)
        return load_checkpoint_file(path, checksum=checksum)

    def load_latest_checkpoint(self) -> LoadedCheckpoint | None:
        """The newest readable checkpoint with its path, or ``None`` when there is none.

        A truncated or corrupt newest checkpoint is skipped with a warning naming it, and the
        next older one is tried. A checkpoint holding pickled objects is refused
        (``UnsafeCheckpointError``): that is tampering, not a crash, and must not be
        silently stepped over. ``CheckpointError`` when checkpoints exist but none is
        readable.
        """
        pointer = self._read_pointer(warn=True)
        candidates = self._resume_candidates(pointer.target)
        skipped: list[str] = []
        unreadable: list[SkippedCheckpoint] = []
        for path in candidates:
            try:
                checksum = recorded_checksum(pointer.records, path.name)
                if path.is_dir():
                    state = _load_sharded(path, checksum)
                else:
                    state = load_checkpoint_file(path, checksum=checksum)
            except CorruptCheckpointError as exc:
                skipped.append(path.name)
                unreadable.append(SkippedCheckpoint(path, str(exc)))
                warnings.warn(
                    f"{exc}; falling back to the previous checkpoint", UserWarning, stacklevel=2
                )
                continue
            if skipped:
                warnings.warn(
                    f"resuming from {path.name} instead of the newest checkpoint "
                    f"({', '.join(skipped)} unreadable)",
                    UserWarning,
                    stacklevel=2,
                )
            step = checkpoint_step(path.name)
            assert step is not None
            return LoadedCheckpoint(path, step, state, tuple(unreadable))
        if skipped:
            raise CheckpointError(
                f"no readable checkpoint in {self.directory}: {', '.join(skipped)} are "
                "all truncated or corrupt"
            )
        return None

    def load_latest(self) -> dict[str, object] | None:
        """The state of the newest readable checkpoint, or ``None`` when there is none."""
        loaded = self.load_latest_checkpoint()
        return loaded.state if loaded is not None else None


def _load_sharded(path: Path, checksum: str | None) -> dict[str, object]:
    """A sharded checkpoint's state once it is verified -- by every rank, which agree on
    the verdict before any loads (``CorruptCheckpointError`` everywhere when any rank
    found it damaged: they fall back together)."""
    problem: CheckpointError | None = None
    try:
        verify_sharded(path, checksum)
    except CheckpointError as exc:  # damaged, or refused (unsafe, unreadable)
        problem = exc
    verdict = agree_corrupt(
        0 if problem is None else 1 if isinstance(problem, CorruptCheckpointError) else 2
    )
    if verdict == 0:
        return read_sharded_state(path)
    if problem is not None and (verdict == 1 or not isinstance(problem, CorruptCheckpointError)):
        raise problem
    if verdict == 1:
        raise CorruptCheckpointError(
            f"sharded checkpoint {path} is damaged as another rank sees it"
        )
    raise CheckpointError(f"sharded checkpoint {path} cannot be used: another rank refused it")
