"""Replace a whole directory so that readers see the old one or the new one, never a mix.

``replace_directory(target, fill)`` is the one way this project installs a directory it
writes as a unit (an export today; shard sets and remote mirrors can take it up):

1. the target is checked first (``check_directory_target``): its name must name a
   directory (not ``.``, ``..`` or a root), the target itself must not be a symbolic link
   (a dangling one included: the swap never follows a link, so it can never replace what
   a link points at), must be a directory if it exists, and nothing on the way to it may
   be a file. A problem is a ``DirectorySwapError`` (a user mistake), before anything is
   created;
2. a staging directory is created exclusively next to the target (``.<name>.tmp-<random>``,
   ``os.mkdir``: a name someone planted is never reused or followed), ``fill`` writes into
   it, and its files are fsynced;
3. ``still_replaceable`` (when given) checks the existing target again just before the
   swap, so a directory that changed while ``fill`` ran is not replaced;
4. an existing target is renamed aside (``.<name>.tmp-old-<random>``), the staging
   directory renamed onto the target's name, and the old one removed. If the second rename
   fails, the old directory is renamed back: the target is never lost. Between the two
   renames (microseconds) the name is briefly absent.

Any failure removes the staging directory and re-raises; nothing is left beside the target.
``shutil.rmtree`` removes a directory without following the links inside it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from speedtronic.state.atomic_io import create_temporary_directory, fsync_directory

__all__ = ["DirectorySwapError", "check_directory_target", "replace_directory", "swap_in"]

_Filled = TypeVar("_Filled")


class DirectorySwapError(ValueError):
    """The target cannot be replaced as a directory (a user mistake, named in the message)."""


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return path.lstat()
    except FileNotFoundError:
        return None
    except NotADirectoryError:  # a file on the way: reported by the caller's walk
        return None


def check_directory_target(target: Path, *, what: str) -> Path:
    """``target`` made absolute (without resolving links), or ``DirectorySwapError``
    naming ``what`` (how messages call it, e.g. ``--output``) when it cannot be replaced
    as a directory (module docstring, step 1)."""
    given = Path(target).expanduser()
    if given.name in ("", ".", ".."):
        raise DirectorySwapError(
            f"{what} {given} does not name a directory of its own (it is '.', '..' or a "
            "root); give a path such as out/model"
        )
    absolute = Path(os.path.abspath(given))  # normalises without following any link
    for ancestor in reversed(absolute.parents):
        found = _lstat(ancestor)
        if found is not None and not stat.S_ISDIR(found.st_mode) and not ancestor.is_dir():
            raise DirectorySwapError(f"{what} {given}: {ancestor} is not a directory")
    found = _lstat(absolute)
    if found is None:
        return absolute
    if stat.S_ISLNK(found.st_mode):
        dangling = "" if absolute.exists() else " (dangling)"
        raise DirectorySwapError(
            f"{what} {given} is a symbolic link{dangling}; name a real directory (links are "
            "never followed: the link's target would be replaced)"
        )
    if not stat.S_ISDIR(found.st_mode):
        raise DirectorySwapError(f"{what} {given} exists and is not a directory")
    return absolute


def _fsync_tree(directory: Path) -> None:
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            if not stat.S_ISREG(os.lstat(path).st_mode):  # a link fill made: never followed
                continue
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_directory(root)


def swap_in(
    staging: Path, target: Path, *, what: str = "directory", any_entry: bool = False
) -> None:
    """Rename the finished directory ``staging`` onto ``target``; an existing ``target`` goes
    aside first, is put back under its name if the second rename fails, and is removed once
    the new one is in place (module docstring, step 4). ``target`` must be a directory
    (else ``DirectorySwapError``) unless ``any_entry``: then whatever is there (a leftover
    file, a planted link) is moved aside and removed, never followed. The one directory swap
    of the project: exports, prepared shard sets, sharded checkpoints and the object-store
    fetch all install their directories through it."""
    found = _lstat(target)
    if found is None:
        os.rename(staging, target)
        return
    is_directory = stat.S_ISDIR(found.st_mode)
    if not is_directory and not any_entry:  # replaced by a link or a file meanwhile
        raise DirectorySwapError(f"{what} {target} changed while it was written: not replaced")
    if is_directory:
        aside = create_temporary_directory(target, "old")  # empty: the rename replaces it
    else:  # a file or link cannot be renamed onto a directory: an unused name instead
        aside = target.with_name(f".{target.name}.tmp-old-{secrets.token_hex(8)}")
    try:
        os.rename(target, aside)
    except BaseException:
        if is_directory:
            with contextlib.suppress(OSError):
                aside.rmdir()
        raise
    try:
        os.rename(staging, target)
    except BaseException:
        os.rename(aside, target)  # the old entry comes back under its name
        raise
    if is_directory:
        shutil.rmtree(aside, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            aside.unlink()


def replace_directory(
    target: Path,
    fill: Callable[[Path], _Filled],
    *,
    what: str = "directory",
    still_replaceable: Callable[[Path], None] | None = None,
) -> _Filled:
    """Install as ``target`` the directory ``fill`` writes (it gets the empty staging
    directory); returns what ``fill`` returns (module docstring). ``still_replaceable``
    gets an existing ``target`` just before the swap and raises to keep it."""
    absolute = check_directory_target(target, what=what)
    try:
        absolute.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DirectorySwapError(
            f"{what} {target}: cannot create {absolute.parent}: {exc.strerror or exc}"
        ) from None
    staging = create_temporary_directory(absolute)
    try:
        result = fill(staging)
        _fsync_tree(staging)
        if still_replaceable is not None and _lstat(absolute) is not None:
            still_replaceable(absolute)
        swap_in(staging, absolute, what=what)
    finally:
        if _lstat(staging) is not None:
            shutil.rmtree(staging, ignore_errors=True)
    fsync_directory(absolute.parent)
    return result
