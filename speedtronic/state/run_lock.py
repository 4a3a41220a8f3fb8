"""One run per run directory, and nothing an earlier run wrote lost without being asked.

``RunDirectoryLock`` is held while a run uses its output directory: the lock file
``<output_dir>/.speedtronic-run.lock`` names the holder (host, PID, start time, its run
directory) and the holder keeps an exclusive ``flock`` on it (POSIX). A second run finds the
lock held and stops at once with ``RunDirectoryError`` naming the holder. The lock is
released by emptying the file; a process that dies without releasing it loses the ``flock``
with it, so the next run on the same host takes the stale lock over with a warning. A lock
naming another host whose lock cannot be checked from here is refused (delete the file once
that run is gone).

A run writes elsewhere too: a checkpoint directory or a metrics file given as an absolute
path, a TensorBoard log directory. ``RunClaim`` (what ``claim_run_directory`` yields) locks
those as well, once the plugins are built: each plugin that writes says where
(``WritesRunPaths``, a ``RunPaths`` of directories and files); a directory gets the same lock
file, a file a hidden ``.<name>.speedtronic-run.lock`` beside it, and anything inside a
directory the run already holds needs nothing more. Two runs with different output
directories and one ``checkpoint.directory`` are then refused like two runs in one directory.

``check_earlier_run`` refuses a fresh (non-resumed) run in a directory that holds an earlier
run's checkpoints or metrics: continue it with ``--resume``, or replace it with
``--overwrite`` (which deletes those files first, with a warning). Which files count is
said by the plugins that write them (``LeavesRunFiles``): this module names none.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import socket
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Protocol, runtime_checkable

from speedtronic.state.append_io import PlantedLinkError, open_to_append, system_path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: the PID in the file is all we have
    fcntl = None  # type: ignore[assignment]  # optional module

__all__ = [
    "LOCK_NAME",
    "BindsOutputDir",
    "LeavesRunFiles",
    "RunClaim",
    "RunDirectoryError",
    "RunDirectoryLock",
    "RunPaths",
    "WritesRunPaths",
    "check_earlier_run",
    "claim_run_directory",
    "earlier_run_files",
    "launched_as_main_process",
    "resolve_run_path",
]

LOCK_NAME = ".speedtronic-run.lock"
"""The lock file in a run directory (empty when no run holds it)."""
FILE_LOCK_SUFFIX = ".speedtronic-run.lock"
"""A file a run writes outside its directories is locked by ``.<name><suffix>`` beside it."""


class RunDirectoryError(RuntimeError):
    """A run directory is in use by another run, or holds an earlier run's files."""


def launched_as_main_process() -> bool:
    """True unless a launcher (``torchrun``) started this process as a rank other than 0;
    only rank 0 locks the run directory (the ranks of one run share it)."""
    return os.environ.get("RANK", "0").strip() in ("", "0")


_MAX_PID = 2**31 - 1
"""No process has a PID above this (``pid_t`` is 32 bits); ``os.kill`` overflows beyond it."""


def _pid_alive(pid: int) -> bool:
    if not 0 < pid <= _MAX_PID:
        return False  # no process has it (the lock file is anyone's to write)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, owned by someone else
        return True
    return True


class RunDirectoryLock:
    """The lock of one run directory; use as a context manager or ``acquire``/``release``.

    ``lock_name`` and ``what`` serve the other paths a run writes (``RunClaim``): the lock
    file's name in ``directory`` and how messages name what is locked (default: ``run
    directory <directory>``); ``run_directory`` is recorded in the lock for whoever meets it."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        lock_name: str = LOCK_NAME,
        what: str | None = None,
        run_directory: Path | None = None,
        advice: str = "wait for it to finish, or give this run another --output-dir",
    ) -> None:
        self.directory = Path(directory)
        self.path = self.directory / lock_name
        self.what = what if what is not None else f"run directory {self.directory}"
        self.run_directory = run_directory
        self.advice = advice
        self._handle: IO[str] | None = None

    def __enter__(self) -> RunDirectoryLock:
        self.acquire()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.release()

    @property
    def held(self) -> bool:
        return self._handle is not None

    def acquire(self) -> None:
        """Take the lock, or raise ``RunDirectoryError`` naming the run that holds it."""
        if self._handle is not None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        try:  # held until release; never through a link planted at the lock's name
            handle = open_to_append(self.path, read=True)
        except PlantedLinkError as exc:
            raise RunDirectoryError(
                f"cannot lock {self.what}: lock file {exc.filename}: {exc.strerror}"
            ) from None
        try:
            self._lock_or_refuse(handle)
        except BaseException:
            handle.close()
            raise
        self._handle = handle

    def _lock_or_refuse(self, handle: IO[str]) -> None:
        holder = _read_holder(handle)
        if fcntl is not None:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                raise self._in_use(holder) from None
        if holder:
            self._take_over_or_refuse(holder)
        handle.seek(0)
        handle.truncate()
        holder = _this_process()
        if self.run_directory is not None:
            holder["run_directory"] = str(self.run_directory)
        handle.write(json.dumps(holder) + "\n")
        handle.flush()
        os.fsync(handle.fileno())

    def _take_over_or_refuse(self, holder: dict[str, object]) -> None:
        """The file names a holder although nobody holds the ``flock`` (or there is none)."""
        pid = holder.get("pid")
        same_host = holder.get("host") == socket.gethostname()
        if not same_host or not isinstance(pid, int) or isinstance(pid, bool):
            raise self._in_use(holder, hint="if that run is gone, delete the lock file")
        alive = _pid_alive(pid)
        if fcntl is None and alive and pid != os.getpid():
            raise self._in_use(holder)
        warnings.warn(
            f"taking over the stale lock {self.path} of PID {pid} on this host: "
            + _why_stale(pid, alive),
            UserWarning,
            stacklevel=4,
        )

    def _in_use(self, holder: dict[str, object], hint: str = "") -> RunDirectoryError:
        run = holder.get("run_directory")
        who = (
            f"PID {holder.get('pid')} on host {holder.get('host')}"
            f" (since {holder.get('started', '?')}"
            + (f"; the run in {run})" if isinstance(run, str) else ")")
            if holder
            else "another process"
        )
        advice = hint or self.advice
        return RunDirectoryError(f"{self.what} is in use by {who}; lock file {self.path}: {advice}")

    def release(self) -> None:
        """Empty the lock file and drop the ``flock`` (the file stays: deleting it would let
        a newcomer lock a fresh file while a waiter still locks the old one)."""
        handle, self._handle = self._handle, None
        if handle is None:
            return
        with contextlib.suppress(OSError):
            handle.seek(0)
            handle.truncate()
            handle.flush()
        handle.close()  # closing drops the flock


def _why_stale(pid: int, alive: bool) -> str:
    """Why a lock whose ``flock`` nobody holds names ``pid`` (POSIX: the holder of a run keeps
    the ``flock`` until it ends, so the run that wrote the file is gone either way)."""
    if pid == os.getpid():
        return "this process wrote it for an earlier run that ended without releasing it"
    if alive:
        return (
            "a process with that PID runs, but it does not hold the lock, so it is not the run "
            "that wrote it (that run ended without releasing it; its PID was reused)"
        )
    return "it no longer runs (it ended without releasing the lock)"


def _this_process() -> dict[str, object]:
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": started}


def _read_holder(handle: IO[str]) -> dict[str, object]:
    """Who the lock file names (``{}`` when it is empty: free). Unreadable content counts as
    a holder on an unknown host, so it is refused rather than overwritten."""
    handle.seek(0)
    text = handle.read(4096).strip()
    if not text:
        return {}
    try:
        holder = json.loads(text)
    except ValueError:
        holder = None
    if not isinstance(holder, dict):
        return {"host": "<unreadable lock file>", "pid": None}
    return holder


# -- an earlier run's files -----------------------------------------------------------------


@runtime_checkable
class LeavesRunFiles(Protocol):
    """A plugin that writes files into the run directory which a fresh run would truncate or
    mix with (checkpoints, a metrics log). The runtime asks every such callback of a run."""

    def earlier_run_files(self) -> list[Path]:
        """The files an earlier run left where this plugin will write (empty: none)."""
        ...


def earlier_run_files(callbacks: Iterable[object]) -> list[Path]:
    """What the run's plugins say an earlier run left behind, in callback order."""
    found: list[Path] = []
    for callback in callbacks:
        if isinstance(callback, LeavesRunFiles):
            found.extend(path for path in callback.earlier_run_files() if path not in found)
    return found


def _describe(files: Sequence[Path]) -> str:
    """``a/metrics.jsonl; 3 files in a/checkpoints``: one entry per directory."""
    by_directory: dict[Path, list[Path]] = {}
    for path in files:
        by_directory.setdefault(path.parent, []).append(path)
    return "; ".join(
        str(group[0]) if len(group) == 1 else f"{len(group)} files in {directory}"
        for directory, group in by_directory.items()
    )


def check_earlier_run(files: Sequence[Path], *, resume: bool, overwrite: bool) -> None:
    """Refuse a fresh run that would silently truncate an earlier run's metrics or mix with
    (and later prune) its checkpoints. ``resume`` continues that run, so it passes;
    ``overwrite`` deletes those files first, with a warning. ``RunDirectoryError`` otherwise."""
    if resume or not files:
        return
    found = _describe(files)
    if not overwrite:
        raise RunDirectoryError(
            f"the run directory holds an earlier run ({found}); a fresh run would "
            "truncate its metrics and mix with its checkpoints. Continue it with --resume, "
            "or replace it with --overwrite (deletes those files), or use another --output-dir "
            "(and checkpoint directory, where that is one of its own)"
        )
    for path in files:
        with contextlib.suppress(FileNotFoundError):
            if path.is_dir() and not path.is_symlink():  # a sharded checkpoint
                shutil.rmtree(path)
            else:
                path.unlink()
    warnings.warn(
        f"--overwrite: deleted the earlier run's files ({found})", UserWarning, stacklevel=2
    )


# -- the other paths a run writes -----------------------------------------------------------


def resolve_run_path(path: str | os.PathLike[str], output_dir: Path) -> Path:
    """Where a plugin's ``path`` is for a run in ``output_dir``: ``path`` itself when it is
    absolute, else under ``output_dir`` (``~`` is expanded). The one rule for every path a
    plugin writes, whether built from ``run.yaml`` (``PluginContext.output_dir``), set up by
    a ``Trainer`` built in Python (``trainer.output_dir``) or locked (``RunClaim``)."""
    candidate = Path(path).expanduser()
    return candidate if candidate.is_absolute() else output_dir / candidate


@runtime_checkable
class BindsOutputDir(Protocol):
    """A plugin whose relative paths stay relative until the run's output directory is known
    (one built in Python without it: ``CheckpointCallback(every_steps=100)``). It resolves
    them at ``setup``; ``resume_from`` asks it before (it must look where the run saves)."""

    def bind_output_dir(self, output_dir: Path) -> None:
        """Resolve the relative paths under ``output_dir`` (``resolve_run_path``)."""
        ...


@dataclass(frozen=True)
class RunPaths:
    """Where a plugin writes during a run, outside what it shares with other runs (a hub
    directory several nodes write is not one): ``directories`` it writes into and single
    ``files``. Absolute, or relative to the run's output directory."""

    directories: tuple[Path, ...] = ()
    files: tuple[Path, ...] = ()


@runtime_checkable
class WritesRunPaths(Protocol):
    """A plugin that writes files during a run (checkpoints, a metrics log, event files).
    The runtime asks every such callback of a run and locks each path for the run
    (``RunClaim``) before anything is written, so two runs never write one path."""

    def run_paths(self, output_dir: Path) -> RunPaths:
        """The directories and files this plugin will write for a run in ``output_dir``."""
        ...


def _special(path: Path) -> bool:
    """``/dev/null``, ``/dev/full``, a FIFO, a terminal: nothing to keep apart."""
    return path.exists() and not path.is_file() and not path.is_dir()


class RunClaim:
    """The locks one run holds: its run directory's (taken by ``claim_run_directory``) and
    those of every other path its plugins write (``cover``). Only the launching process
    (rank 0) locks (``enabled``); ``release`` drops them all."""

    def __init__(self, directory: Path, *, enabled: bool) -> None:
        self.directory = directory
        self.enabled = enabled
        self._locks: list[RunDirectoryLock] = []
        self._held_directories: list[Path] = []

    def _covered(self, path: Path) -> bool:
        return any(path.is_relative_to(held) for held in self._held_directories)

    def hold_run_directory(self) -> None:
        if self.enabled:
            self._take(RunDirectoryLock(self.directory, run_directory=self.directory))
            self._held_directories.append(self.directory)

    def cover(self, callbacks: Iterable[object]) -> None:
        """Lock every path the ``callbacks`` write (``WritesRunPaths``) that the run does not
        hold yet: ``RunDirectoryError`` naming the path and the run that holds it. A path
        whose lock file cannot be created (a read-only directory) is left unlocked, with a
        warning; ``/dev/null`` and the like are not locked."""
        if not self.enabled:
            return
        for callback in callbacks:
            if not isinstance(callback, WritesRunPaths):
                continue
            declared = callback.run_paths(self.directory)
            writer = getattr(callback, "display_name", type(callback).__name__)
            for directory in declared.directories:
                self._cover(self._absolute(directory), writer, is_directory=True)
            for file in declared.files:
                absolute = resolve_run_path(file, self.directory)
                if system_path(absolute):  # /dev/stdout, /dev/null: nothing to keep apart
                    continue
                # The file's own name is kept: a link planted there is its writer's to
                # refuse, never a reason to put a lock file beside whatever it leads to.
                named = absolute.parent.resolve() / absolute.name
                self._cover(named, writer, is_directory=False)

    def _absolute(self, path: Path) -> Path:
        return resolve_run_path(path, self.directory).resolve()

    def _cover(self, path: Path, writer: str, *, is_directory: bool) -> None:
        if self._covered(path) or _special(path):
            return
        kind = "directory" if is_directory else "file"
        lock = RunDirectoryLock(
            path if is_directory else path.parent,
            lock_name=LOCK_NAME if is_directory else f".{path.name}{FILE_LOCK_SUFFIX}",
            what=f"{kind} {path} (written by this run's {writer} callback)",
            run_directory=self.directory,
            advice=f"wait for it to finish, or give this run's {writer} callback a {kind} of "
            "its own",
        )
        try:
            self._take(lock)
        except OSError as exc:  # EACCES, EROFS: no lock file can be created there
            warnings.warn(
                f"cannot lock {path} ({exc.strerror or exc}): nothing keeps another run from "
                "writing it at the same time",
                UserWarning,
                stacklevel=4,
            )
            return
        if is_directory:
            self._held_directories.append(path)

    def _take(self, lock: RunDirectoryLock) -> None:
        lock.acquire()
        self._locks.append(lock)

    def release(self) -> None:
        """Drop every lock (the run directory's last)."""
        locks, self._locks = self._locks, []
        self._held_directories = []
        for lock in reversed(locks):
            lock.release()


@contextlib.contextmanager
def claim_run_directory(output_dir: str | os.PathLike[str]) -> Iterator[RunClaim]:
    """What the CLI and ``train_from_config`` hold around building and fitting a run: the
    lock of the run directory, taken by rank 0 only (the ranks of one run share it). Yields
    the ``RunClaim`` (its ``directory`` is the absolute run directory); ``build_runtime``
    then locks what the plugins write (``RunClaim.cover``) and checks for an earlier run
    (``build_runtime(overwrite=...)``), since the plugins know which files they write."""
    directory = Path(output_dir).expanduser().resolve()
    claim = RunClaim(directory, enabled=launched_as_main_process())
    claim.hold_run_directory()
    try:
        yield claim
    finally:
        claim.release()
