"""Checkpoint files on disk: atomic writes, the ``latest.json`` pointer, retention, safe loads.

Layout of a checkpoint directory::

    latest.json                 {"step": 4, "file": "step_000000000004.pt"}
    step_000000000002.pt
    step_000000000004.pt
    .step_000000000006.pt.tmp-4242   a write in progress (or left by a killed process)

A checkpoint is written to a hidden temp file in the same directory, flushed and fsynced,
renamed onto its final name, and the directory is fsynced; only then is ``latest.json``
rewritten the same way, and only then are old checkpoints pruned. A process killed at any
moment therefore leaves the previous checkpoint and pointer intact. ``latest.json`` is the
commit record: it names the newest *complete* checkpoint and nothing outside the directory.

Loads use ``torch.load(..., weights_only=True)``: a file that holds pickled Python objects is
refused (``UnsafeCheckpointError``) instead of executing them. Saves check the same rule
up front (``plain_state``), so a callback that puts an arbitrary object in its state fails at
save time with the key that is wrong, not at resume time.

This module is the storage layer; *when* to save is the checkpoint callback's business
(``callbacks/checkpoint.py``), saving on a background thread is
``speedtronic.checkpoint_async``, and loading into a trainer is ``speedtronic.resume``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import signal
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from speedtronic.rng import capture_rng_state, restore_rng_state

__all__ = [
    "POINTER_NAME",
    "CheckpointError",
    "CheckpointManager",
    "CorruptCheckpointError",
    "LoadedCheckpoint",
    "UnsafeCheckpointError",
    "atomic_json_dump",
    "atomic_torch_save",
    "capture_rng_state",
    "checkpoint_step",
    "load_checkpoint_file",
    "plain_state",
    "requeue_exit_code",
    "restore_rng_state",
    "signal_stop_reason",
]

POINTER_NAME = "latest.json"
"""The pointer file naming the newest complete checkpoint."""

STEP_DIGITS = 12
_CHECKPOINT_NAME = re.compile(r"step_(\d+)\.pt")
_TEMP_NAME = re.compile(r"\.(?:step_\d+\.pt|latest\.json)\.tmp-(\d+)")
_FORBIDDEN_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")

PathLike = str | os.PathLike[str]


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, found or read."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file is truncated or damaged (``load_latest`` falls back past it)."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint holds pickled Python objects; it is refused rather than executed."""


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint file name (``step_000000000012.pt`` -> 12), else ``None``.

    Only the exact ``step_<digits>.pt`` form counts: temp files, directories' other
    contents and anything with a path separator are not checkpoints.
    """
    match = _CHECKPOINT_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


# -- atomic writes ---------------------------------------------------------------------------


def _temp_path_for(path: Path) -> Path:
    # Hidden, PID-suffixed, and never ending in ".pt": it can never match a checkpoint name.
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (POSIX; Windows cannot open directories)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, write_contents: Callable[[BinaryIO], None]) -> None:
    """Write via a temp file in the same directory: flush, fsync, rename, fsync the dir."""
    if not path.parent.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        _fsync_directory(path.parent.parent)  # the new directory's own entry must last too
    temp = _temp_path_for(path)
    try:
        with open(temp, "wb") as handle:
            write_contents(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
        _fsync_directory(path.parent)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            temp.unlink()
        if isinstance(exc, Exception) and not isinstance(exc, CheckpointError):
            raise CheckpointError(f"could not write {path}: {type(exc).__name__}: {exc}") from exc
        raise


def atomic_torch_save(state: object, path: PathLike) -> None:
    """``torch.save`` to ``path`` atomically and durably (a reader sees the old file or the
    complete new one, also after a power loss)."""
    _atomic_write(Path(path), lambda handle: torch.save(state, handle))


def atomic_json_dump(value: object, path: PathLike) -> None:
    """Write ``value`` as indented JSON to ``path``, atomically and durably."""
    data = (json.dumps(value, indent=2, sort_keys=True) + "\n").encode("utf-8")

    def write(handle: BinaryIO) -> None:
        handle.write(data)

    _atomic_write(Path(path), write)


# -- what may go into a checkpoint ------------------------------------------------------------

_PLAIN_LEAVES = (bool, int, float, complex, str, bytes, bytearray, type(None))
_TORCH_LEAVES = (torch.Size, torch.dtype, torch.device)
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


class _NotPlain(Exception):
    """Internal: where a state holds something a weights-only load refuses."""


def plain_state(state: Mapping[str, object]) -> dict[str, object]:
    """``state`` in the form ``torch.load(weights_only=True)`` accepts, or ``CheckpointError``.

    Allowed: tensors, numbers, strings, bytes, ``None``, torch sizes/dtypes/devices, and
    dicts/lists/tuples/sets of those. Containers are rebuilt (tensors are not copied) and
    subclasses of the plain types become the plain type -- a ``str`` subclass such as
    ``torch.__version__``, an ``IntEnum``, a ``defaultdict``, a named tuple -- because a
    subclass would be pickled by class name and refused on load. Anything else is an error
    naming where it sits, e.g. ``state['callbacks']['ema']['fn'] is a builtins.function``.
    """
    try:
        plain = _plain(dict(state), "state")
    except _NotPlain as exc:
        raise CheckpointError(
            f"cannot checkpoint this state: {exc}; checkpoints may hold only tensors, numbers, "
            "strings, None and dicts/lists/tuples of those (they are loaded with "
            "torch.load(weights_only=True), which refuses pickled objects)"
        ) from None
    assert isinstance(plain, dict)
    return plain


def _plain(value: object, where: str) -> object:
    kind = type(value)
    if kind in _TENSOR_TYPES or kind in _PLAIN_LEAVES or isinstance(value, _TORCH_LEAVES):
        return value
    if isinstance(value, torch.Tensor):
        raise _NotPlain(f"{where} is a tensor subclass {kind.__module__}.{kind.__qualname__}")
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, dict):
        items = [
            (_plain(k, f"{where} key {k!r}"), _plain(v, f"{where}[{k!r}]"))
            for k, v in value.items()
        ]
        return OrderedDict(items) if isinstance(value, OrderedDict) else dict(items)
    if isinstance(value, list | tuple | set):
        parts = [_plain(item, f"{where}[{index}]") for index, item in enumerate(value)]
        if isinstance(value, list):
            return parts
        return tuple(parts) if isinstance(value, tuple) else set(parts)
    raise _NotPlain(f"{where} is a {kind.__module__}.{kind.__qualname__}")


# -- loading -------------------------------------------------------------------------------


def _first_line(exc: BaseException, limit: int = 200) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= limit else line[:limit] + "..."


def load_checkpoint_file(path: PathLike) -> dict[str, object]:
    """Load one checkpoint with ``weights_only=True`` onto the CPU.

    Raises ``UnsafeCheckpointError`` when it holds pickled objects, ``CorruptCheckpointError``
    when it is truncated or damaged, ``CheckpointError`` when it is missing or not a dict.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a file")
    _check_readable(path)
    try:
        # The file opened and read: from here on an OSError is damage, not access. torch
        # raises it (e.g. "[Errno 22] Invalid argument") for a zip cut short.
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        forbidden = _FORBIDDEN_GLOBAL.search(str(exc))
        if forbidden is None:
            raise CorruptCheckpointError(
                f"checkpoint {path} is unreadable (corrupt pickle data): {_first_line(exc)}"
            ) from exc
        raise UnsafeCheckpointError(
            f"refusing to load {path}: it contains a pickled Python object "
            f"({forbidden.group(1)}), and loading it could run arbitrary code. speedtronic "
            "checkpoints hold only tensors and plain data (torch.load weights_only=True). "
            "If you wrote this file yourself and trust it, convert it with "
            "torch.load(weights_only=False) in a separate script."
        ) from exc
    except Exception as exc:  # torch: OSError/RuntimeError/EOFError/KeyError/... for damage
        raise CorruptCheckpointError(
            f"checkpoint {path} is unreadable (truncated or corrupt): "
            f"{type(exc).__name__}: {_first_line(exc)}"
        ) from exc
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{path} is not a speedtronic checkpoint: it holds a {type(state).__name__}, "
            "expected a dict"
        )
    return state


def _check_readable(path: Path) -> None:
    """``CheckpointError`` when ``path`` cannot be opened and read at all (permissions, an
    I/O error): that is not a damaged checkpoint to step over, it is an environment problem."""
    try:
        with open(path, "rb") as handle:
            handle.read(1)
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A checkpoint read from disk: where it came from and its state."""

    path: Path
    step: int
    state: dict[str, object]


# -- the manager ------------------------------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    if os.name != "posix":
        return True  # os.kill(pid, 0) would terminate the process on Windows: keep the file
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OSError:
        return True  # cannot tell: keep the file
    return True


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

    def __repr__(self) -> str:
        return (
            f"CheckpointManager({str(self.directory)!r}, every_steps={self.every_steps}, "
            f"keep_last={self.keep_last}, enabled={self.enabled})"
        )

    @property
    def pointer_path(self) -> Path:
        return self.directory / POINTER_NAME

    def should_save(self, step: int) -> bool:
        """True when checkpointing is enabled and ``step`` is a positive interval multiple."""
        return self.enabled and step > 0 and step % self.every_steps == 0

    def path_for(self, step: int) -> Path:
        """``<directory>/step_<step, 12 digits>.pt``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self.directory / f"step_{step:0{STEP_DIGITS}d}.pt"

    # -- writing ----------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, object]) -> Path:
        """Write the checkpoint of ``step``, then point ``latest.json`` at it, then prune.

        ``state`` goes through ``plain_state``: ``CheckpointError`` (nothing is written) when
        it holds an object that a ``weights_only`` load would refuse.
        """
        path = self.path_for(step)
        atomic_torch_save(plain_state(state), path)
        atomic_json_dump({"step": step, "file": path.name}, self.pointer_path)
        self.prune()
        return path

    def prune(self) -> list[Path]:
        """Delete all but the newest ``keep_last`` checkpoints (never the one ``latest.json``
        names) and temp files left by processes that no longer run. Returns what was deleted."""
        removed = self._remove_stale_temp_files()
        if self.keep_last is None:
            return removed
        protected = self._pointer_target(warn=False)
        for path in self.checkpoint_paths()[: -self.keep_last]:
            if path == protected:
                continue
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
        return removed

    def _remove_stale_temp_files(self) -> list[Path]:
        removed: list[Path] = []
        if not self.directory.is_dir():
            return removed
        for entry in self.directory.iterdir():
            match = _TEMP_NAME.fullmatch(entry.name)
            if match is None:
                continue
            pid = int(match.group(1))
            if pid == os.getpid() or _pid_alive(pid):
                continue
            with contextlib.suppress(OSError):
                entry.unlink()
                removed.append(entry)
        return removed

    def copy_to(self, destination: PathLike) -> Path:
        """Copy the latest checkpoint to ``destination`` (a file path, or an existing
        directory to copy into), atomically. ``CheckpointError`` when there is none."""
        source = self.latest_path()
        if source is None:
            raise CheckpointError(f"no checkpoint to copy in {self.directory}")
        target = Path(destination)
        if target.is_dir():
            target = target / source.name

        def copy(handle: BinaryIO) -> None:
            with open(source, "rb") as src:
                shutil.copyfileobj(src, handle, length=16 * 1024 * 1024)

        _atomic_write(target, copy)
        return target

    # -- finding ----------------------------------------------------------------------

    def checkpoint_paths(self) -> list[Path]:
        """Every ``step_<digits>.pt`` file directly in the directory, oldest step first."""
        if not self.directory.is_dir():
            return []
        found: list[tuple[int, Path]] = []
        for entry in self.directory.iterdir():
            step = checkpoint_step(entry.name)
            if step is not None and entry.is_file() and self._inside(entry):
                found.append((step, entry))
        return [path for _, path in sorted(found)]

    def _inside(self, path: Path) -> bool:
        """True when ``path`` really lives in the directory (a symlink to a file elsewhere
        does not count: neither the pointer nor a scan may lead out of the directory)."""
        if not path.is_symlink():
            return path.parent == self.directory
        try:
            return path.resolve().parent == self.directory.resolve()
        except OSError:
            return False

    _checkpoint_paths = checkpoint_paths  # the original's private name

    def newest_step(self) -> int | None:
        """The highest step of any checkpoint file present (complete or not named by the
        pointer), or ``None``."""
        paths = self.checkpoint_paths()
        return checkpoint_step(paths[-1].name) if paths else None

    def _pointer_target(self, *, warn: bool) -> Path | None:
        """The checkpoint ``latest.json`` names, after validation; ``None`` (with a warning
        when ``warn``) when the pointer is absent, malformed, tampered or dangling."""
        pointer = self.pointer_path
        if not pointer.is_file():
            return None
        try:
            target, problem = self._validate_pointer(json.loads(pointer.read_text("utf-8")))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            target, problem = None, f"it is not readable JSON ({_first_line(exc)})"
        if problem is not None and warn:
            warnings.warn(
                f"ignoring checkpoint pointer {pointer}: {problem}; "
                f"looking for checkpoints in {self.directory} instead",
                UserWarning,
                stacklevel=4,
            )
        return target

    def _validate_pointer(self, content: object) -> tuple[Path | None, str | None]:
        if not isinstance(content, dict) or not isinstance(content.get("file"), str):
            return None, 'it must be a JSON object with a string "file"'
        name: str = content["file"]
        step = checkpoint_step(name)
        if step is None:
            # Also rejects "../x.pt", "/abs/step_1.pt", "sub/step_1.pt": no separators allowed.
            return None, f"{name!r} is not a checkpoint file name (step_<digits>.pt) in it"
        if content.get("step") not in (None, step):
            return None, f"its step {content.get('step')!r} does not match file {name!r}"
        target = self.directory / name
        if not self._inside(target):
            return None, f"{name!r} resolves outside the checkpoint directory"
        if not target.is_file():
            return None, f"it names {name!r}, which does not exist"
        return target, None

    def latest_path(self) -> Path | None:
        """The checkpoint to resume from: the one ``latest.json`` names when the pointer is
        valid, else the highest-step checkpoint file; ``None`` when there is none."""
        target = self._pointer_target(warn=True)
        if target is not None:
            return target
        paths = self.checkpoint_paths()
        return paths[-1] if paths else None

    def _resume_candidates(self) -> list[Path]:
        target = self._pointer_target(warn=True)
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
        """Load one checkpoint file (``weights_only=True``, onto the CPU)."""
        return load_checkpoint_file(path)

    def load_latest_checkpoint(self) -> LoadedCheckpoint | None:
        """The newest readable checkpoint with its path, or ``None`` when there is none.

        A truncated or corrupt newest checkpoint is skipped with a warning naming it, and the
        next older one is tried. A checkpoint holding pickled objects is refused
        (``UnsafeCheckpointError``): that is tampering, not a crash, and must not be
        silently stepped over. ``CheckpointError`` when checkpoints exist but none is
        readable.
        """
        candidates = self._resume_candidates()
        skipped: list[str] = []
        for path in candidates:
            try:
                state = self.load(path)
            except CorruptCheckpointError as exc:
                skipped.append(path.name)
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
            return LoadedCheckpoint(path, step, state)
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


# -- signals ------------------------------------------------------------------------------

_SIGNAL_REASON_PREFIX = "signal "


def signal_stop_reason(received: signal.Signals) -> str:
    """The stop reason of a fit stopped by ``received`` (``"signal SIGTERM"``), in the form
    ``requeue_exit_code`` reads back."""
    return f"{_SIGNAL_REASON_PREFIX}{received.name}"


def requeue_exit_code(stop_reason: str | None) -> int | None:
    """The exit status for a fit stopped by a signal (``"signal SIGTERM"`` -> 143, SIGINT ->
    130: the shell's 128 + signal number), or ``None`` when it was not stopped by one.

    The checkpoint callback stops the fit with such a reason after saving; a launcher that
    exits with this status tells a scheduler the job was interrupted, not finished (0) and
    not failed (1), so it can be requeued and resumed with ``--resume``.
    """
    if not stop_reason or not stop_reason.startswith(_SIGNAL_REASON_PREFIX):
        return None
    name = stop_reason.removeprefix(_SIGNAL_REASON_PREFIX).strip()
    try:
        return 128 + int(signal.Signals[name])
    except KeyError:
        return None
