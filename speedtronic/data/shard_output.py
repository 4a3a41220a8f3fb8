"""Where ``speedtronic prepare`` writes: the checks on ``--output``, the staging directory,
and the swap that publishes a finished shard set.

``--output`` must name a directory by a path of its own (not ``.`` or ``..``, not a
symbolic link, not below a file). It may be absent or empty; with ``--overwrite`` it may
also be a shard set this program wrote, and nothing else: its ``index.json`` parses as a
manifest and every entry in the directory is a regular file the manifest lists (the
shards, the tokenizer copy, the manifest itself). Anything more -- a source tree holding an
unrelated ``index.json``, a note, a subdirectory -- is refused, naming what would have been
deleted. A set that a run is reading is not replaced either (``shard_lock``).

Publishing swaps the staging directory in (``speedtronic.state.directory_swap.swap_in``): over
an absent or empty output, or, when replacing, under the exclusive lock, the old set moved
aside, the new one renamed in (the old one put back if that fails) and the old one deleted:
the output is always one complete set.
"""

from __future__ import annotations

import os
import shutil
import stat
import uuid
from pathlib import Path

from speedtronic.data.loss_masks import listed_mask_files
from speedtronic.data.shard_lock import hold_exclusive
from speedtronic.data.shards import MANIFEST_NAME, ManifestError, read_manifest
from speedtronic.data.text import DataSourceError
from speedtronic.state.atomic_io import fsync_directory
from speedtronic.state.directory_swap import swap_in

__all__ = ["check_output", "discard", "missing_parent", "publish", "staging_directory"]

_SHOWN = 5


class _OutputError(DataSourceError):
    """An ``--output`` that ``prepare`` may not write (or replace)."""


def _refuse_path(output: Path) -> None:
    """A path that cannot name a new shard directory: ``.``, a link, below a file."""
    if output.name in ("", ".", ".."):
        raise _OutputError(
            f"--output {output}: name the shard directory itself (a new or empty directory, "
            "or a shard set with --overwrite), not . or .."
        )
    if output.is_symlink():
        target = os.readlink(output)
        dangling = "" if output.exists() else ", which does not exist"
        raise _OutputError(
            f"--output {output}: a symbolic link (to {target}{dangling}); name the directory itself"
        )
    for parent in output.parents:
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise _OutputError(f"--output {output}: {parent} is not a directory")
            break


def _unlisted(output: Path, listed: set[str]) -> list[str]:
    """Entries of ``output`` that are not regular files the manifest lists."""
    extra = []
    for entry in sorted(os.scandir(output), key=lambda item: item.name):
        mode = entry.stat(follow_symlinks=False).st_mode
        if entry.name not in listed or not stat.S_ISREG(mode):
            extra.append(entry.name + ("/" if stat.S_ISDIR(mode) else ""))
    return extra


def _check_replaceable(output: Path) -> None:
    """Refuse to replace anything but a complete shard set this program wrote."""
    try:
        manifest = read_manifest(output)
    except ManifestError as exc:
        raise _OutputError(
            f"--output {output}: --overwrite replaces only a directory of token shards "
            f"written by prepare (one with {MANIFEST_NAME}), and this one is not ({exc}): "
            "choose another --output"
        ) from None
    listed = {MANIFEST_NAME, *(shard.file for shard in manifest.shards)}
    listed |= listed_mask_files(output)  # a fine-tuning set's loss masks are prepare's too
    if manifest.tokenizer.file is not None:
        listed.add(manifest.tokenizer.file)
    extra = _unlisted(output, listed)
    if extra:
        shown = ", ".join(extra[:_SHOWN]) + (", ..." if len(extra) > _SHOWN else "")
        raise _OutputError(
            f"--output {output}: --overwrite would delete {len(extra)} entr"
            f"{'y' if len(extra) == 1 else 'ies'} that its {MANIFEST_NAME} does not list "
            f"({shown}); it replaces only a shard set written by prepare: move them out or "
            "choose another --output"
        )
    lock = hold_exclusive(output, MANIFEST_NAME, f"--output {output}")  # refuse early
    if lock is not None:
        lock.close()


def check_output(output: Path, overwrite: bool) -> bool:
    """Whether an existing shard set is to be replaced; an ``_OutputError`` when the output
    may not be written (module docstring)."""
    _refuse_path(output)
    if output.exists() and not output.is_dir():
        raise _OutputError(f"--output {output}: exists and is not a directory")
    if not output.is_dir() or not any(output.iterdir()):
        return False
    if not overwrite:
        raise _OutputError(
            f"--output {output}: the directory is not empty; pass --overwrite to replace the "
            "shards in it (the old shards stay until the new set is complete)"
        )
    if not os.path.lexists(output / MANIFEST_NAME):
        raise _OutputError(
            f"--output {output}: --overwrite replaces only a directory of token shards (one "
            f"with {MANIFEST_NAME}), and this one is not: choose another --output"
        )
    _check_replaceable(output)
    return True


def staging_directory(output: Path) -> Path:
    """A new hidden directory next to ``output`` to write the set into (its missing parent
    directories made too; ``discard`` removes them again)."""
    staging = output.parent / f".{output.name}.prepare-{uuid.uuid4().hex[:12]}"
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
    except OSError as exc:
        raise _OutputError(
            f"--output {output}: cannot create {staging} ({exc.strerror or exc})"
        ) from None
    return staging


def missing_parent(output: Path) -> Path | None:
    """The outermost of ``output``'s parent directories that does not exist yet (None: its
    parent exists): what a failed run removes again, so it leaves nothing behind."""
    missing = None
    for parent in output.parents:
        if parent.exists() or parent.is_symlink():
            break
        missing = parent
    return missing


def discard(staging: Path, made: Path | None) -> None:
    """Remove a staging directory and, up to ``made``, the parents made for it (if empty)."""
    shutil.rmtree(staging, ignore_errors=True)
    if made is None:
        return
    folder = staging.parent
    while True:
        try:
            folder.rmdir()
        except OSError:  # not empty: another run's, or the output after all
            return
        if folder == made:
            return
        folder = folder.parent


def publish(staging: Path, output: Path, replacing: bool) -> None:
    """Make the staging directory the output (module docstring)."""
    lock = hold_exclusive(output, MANIFEST_NAME, f"--output {output}") if replacing else None
    try:
        swap_in(staging, output, what="--output")
    finally:
        if lock is not None:
            lock.close()
    fsync_directory(output.parent)
