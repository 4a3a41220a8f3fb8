"""Where ``speedtronic export`` may write, and the one way it installs what it wrote.

An export is installed as a unit (``speedtronic.state.directory_swap``: a staging sibling,
fsynced, renamed onto ``output``; the old directory restored if that fails) together with a
record of its files, ``EXPORT_RECORD``. What ``output`` may be (``check_export_target``):

* never a directory a live run holds, nor one inside it (``speedtronic.state.run_holder``:
  the run lock covers everything under its directory); while the export writes it holds a
  shared lock on those lock files, so no run starts there meanwhile;
* never a symbolic link (a dangling one too), ``.``/``..`` or a path under a file;
* absent or empty; or, with ``overwrite``, provably an earlier export: its record and only
  the regular files the record lists. Anything else is refused, listing what ``overwrite``
  would have removed, and is left as it is.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from speedtronic.state.directory_swap import (
    DirectorySwapError,
    check_directory_target,
    replace_directory,
)
from speedtronic.state.run_holder import RunHeldError, runs_kept_out

__all__ = ["EXPORT_RECORD", "ExportError", "check_export_target", "install_export"]

EXPORT_RECORD = ".speedtronic-export.json"
"""The file naming what an export wrote: ``--overwrite`` replaces only such a directory."""
_RECORD_LIMIT = 1 << 20
_Written = TypeVar("_Written")


class ExportError(ValueError):
    """The model or the output directory cannot be exported as asked (a user mistake)."""


def _read_record(directory: Path) -> frozenset[str] | None:
    """The file names the export record of ``directory`` lists; ``None`` when it has none
    (or one that is not a regular file holding such a list: it proves nothing)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(directory / EXPORT_RECORD, flags)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            fields = json.loads(handle.read(_RECORD_LIMIT).decode("utf-8"))
        except ValueError:
            return None
    files = fields.get("files") if isinstance(fields, dict) else None
    if not isinstance(files, list) or not all(isinstance(name, str) for name in files):
        return None
    return frozenset(files)


def _regular_file(path: Path) -> bool:
    return stat.S_ISREG(path.lstat().st_mode)


def _refuse_unless_export(directory: Path, shown: Path) -> None:
    """``ExportError`` listing what ``--overwrite`` would remove, unless ``directory``
    holds an export record and nothing but the regular files it lists."""
    entries = sorted(os.listdir(directory))
    listed = _read_record(directory)
    if listed is None:
        reason, extra = f"it holds no {EXPORT_RECORD}", entries
    else:
        reason = "it holds files the export did not write"
        extra = [
            name
            for name in entries
            if name != EXPORT_RECORD and (name not in listed or not _regular_file(directory / name))
        ]
    if extra:
        named = ", ".join(extra[:6]) + (f" and {len(extra) - 6} more" if len(extra) > 6 else "")
        raise ExportError(
            f"--output {shown} is not a directory speedtronic export wrote ({reason}); "
            f"--overwrite replaces only an earlier export, and would remove {named}: remove "
            "them yourself or choose another --output"
        )


def _check_contents(directory: Path, shown: Path, *, overwrite: bool) -> None:
    if not any(directory.iterdir()):
        return
    if not overwrite:
        raise ExportError(
            f"--output {shown} is not empty; pass --overwrite to replace an earlier export"
        )
    _refuse_unless_export(directory, shown)


def check_export_target(output: Path, *, overwrite: bool) -> Path:
    """``output`` made absolute, or ``ExportError`` unless it can receive an export: not a
    link, not under a file, not in a directory a live run holds, and absent, empty, or --
    with ``overwrite`` -- an earlier export (its record and the files it lists, nothing
    else)."""
    shown = Path(output).expanduser()
    try:
        target = check_directory_target(shown, what="--output")
        with runs_kept_out(target):
            if target.is_dir():
                _check_contents(target, shown, overwrite=overwrite)
    except (DirectorySwapError, RunHeldError) as exc:
        raise _as_export_error(exc, shown) from None
    return target


def _as_export_error(exc: Exception, shown: Path) -> ExportError:
    if isinstance(exc, RunHeldError):
        return ExportError(f"--output {shown}: {exc}; export never writes where a run writes")
    return ExportError(str(exc))


def _write_record(directory: Path, files: tuple[str, ...]) -> None:
    """The record that lets a later ``--overwrite`` prove the directory is an export."""
    text = json.dumps({"written_by": "speedtronic export", "files": list(files)}, indent=2)
    (directory / EXPORT_RECORD).write_text(text + "\n", encoding="utf-8")


def install_export(
    target: Path, shown: Path, fill: Callable[[Path], _Written], *, overwrite: bool
) -> tuple[_Written, tuple[str, ...]]:
    """Install as ``target`` (``shown``: as the user named it) the directory ``fill``
    writes, with its record; what ``fill`` returns and the files it wrote. ``ExportError``,
    with ``target`` untouched and nothing left beside it, when ``target`` cannot be
    replaced (checked again just before the swap) or cannot be written."""

    def fill_and_record(staging: Path) -> tuple[_Written, tuple[str, ...]]:
        written = fill(staging)
        files = tuple(sorted(path.name for path in staging.iterdir()))
        _write_record(staging, files)
        return written, files

    def still_replaceable(existing: Path) -> None:
        _check_contents(existing, shown, overwrite=overwrite)

    try:
        with runs_kept_out(target):  # no run starts in it while it is replaced
            return replace_directory(
                target, fill_and_record, what="--output", still_replaceable=still_replaceable
            )
    except (DirectorySwapError, RunHeldError) as exc:
        raise _as_export_error(exc, shown) from None
    except OSError as exc:  # permissions, a full disk: nothing was left behind
        where = f" ({exc.filename})" if exc.filename else ""
        raise ExportError(
            f"--output {shown}: cannot write it: {exc.strerror or exc}{where}"
        ) from None
