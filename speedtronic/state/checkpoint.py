"""Checkpoint files on disk: atomic writes, the ``latest.json`` pointer, retention, safe loads.

Layout of a checkpoint directory::

    latest.json                 {"step": 4, "file": "step_000000000004.pt",
                                 "checkpoints": {"step_000000000004.pt": {"sha256": ...}, ...}}
    step_000000000002.pt
    step_000000000004.pt
    .step_000000000006.pt.tmp-4242   a write in progress (or left by a killed process)
    step_000000000008.dcp/      a sharded checkpoint of an FSDP run: one directory, each
                                rank's shard in it (``speedtronic.state.sharded_checkpoint``)

    best.json                   latest.json's format for the best checkpoint by a monitored
                                metric, plus "monitor", "mode" and "value" (when asked for)

A checkpoint is written to a hidden temp file in the same directory (created exclusively,
never through a symlink), flushed and fsynced, renamed onto its final name, and the directory
is fsynced; only then is ``latest.json`` rewritten the same way -- without the records of the
checkpoints retention is about to delete -- and only then are those deleted. A process killed
at any moment therefore leaves the previous checkpoint and pointer intact, and the pointer
never records a file that is gone. ``latest.json`` is the commit record: it names the newest
*complete* checkpoint and nothing outside the directory.

Integrity: ``torch.save`` writes a zip archive that stores a CRC-32 of every record; a save
records the SHA-256 of that record index (names, offsets, sizes, CRC-32s) in the pointer, and
a load checks the index against it and every record's bytes against their CRC-32 before
``torch.load``. A mismatch is damage (``CorruptCheckpointError``, fall back to an older
checkpoint). This costs no second pass over the data at save time.

Loads go through ``speedtronic.state.safe_load.restricted_load`` (``torch.load(...,
weights_only=True)``, the one unpickling path of this layer): a file that holds pickled Python
objects is refused (``UnsafeCheckpointError``) instead of executing them. Saves check the same rule
up front (``plain_state``), so a callback that puts an arbitrary object in its state fails at
save time with the key that is wrong, not at resume time.

Sharded checkpoints (``parallel.strategy: fsdp``) follow the same rules: the directory is
complete before it gets its final name, the pointer records the SHA-256 of its manifest
(which holds every file's), ``keep_last`` counts it like a file, and one that is incomplete
or damaged -- a rank's shard missing, say -- is skipped for an older one. Their ``save`` is a
collective: every rank calls it, rank 0 commits.

This module is the storage layer; *when* to save is the checkpoint callback's business
(``callbacks/checkpoint.py``), saving on a background thread is
``speedtronic.state.checkpoint_async``, and loading into a trainer is ``speedtronic.state.resume``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import mmap
import os
import re
import reprlib
import shutil
import signal
import struct
import warnings
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from speedtronic.state.atomic_io import atomic_write
from speedtronic.state.errors import (
    CheckpointError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    first_line,
)
from speedtronic.state.rng import capture_rng_state, restore_rng_state
from speedtronic.state.safe_load import restricted_load
from speedtronic.state.sharded_checkpoint import (
    SHARDED_SUFFIX,
    agree_corrupt,
    copy_sharded,
    is_sharded_state,
    read_sharded_state,
    verify_sharded,
    write_sharded,
)
from speedtronic.state.time_budget import TIME_BUDGET_EXIT_CODE, is_time_budget_stop

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

POINTER_NAME = "latest.json"
"""The pointer file naming the newest complete checkpoint."""

BEST_POINTER_NAME = "best.json"
"""The pointer file naming the best checkpoint by a monitored metric (``note_best``)."""

STEP_DIGITS = 12
MAX_STEP = 10**STEP_DIGITS - 1
"""The highest step a checkpoint file name can carry (12 digits: 31 years at 1 step/ms)."""
_CHECKPOINT_NAME = re.compile(rf"step_(\d{{{STEP_DIGITS}}})\.(?:pt|dcp)")
_TEMP_NAME = re.compile(
    r"\.(?:step_\d+\.(?:pt|dcp)|latest\.json|best\.json)\.(?:tmp|old)-(\d{1,10})(?:-[0-9a-f]{16})?"
)
"""A temp name this module writes: the writer's PID, then a random part when the plain name
was taken (``speedtronic.state.atomic_io.create_temporary``)."""
_MAX_PID = 2**31 - 1

PathLike = str | os.PathLike[str]


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint file name (``step_000000000012.pt`` -> 12; a sharded
    checkpoint's directory ``step_000000000012.dcp`` too), else ``None``.

    Only the exact ``step_<12 digits>.pt`` form counts: temp files, directories' other
    contents, anything with a path separator and junk such as ``step_99999999999999999.pt``
    (more digits than any save writes) are not checkpoints.
    """
    match = _CHECKPOINT_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


# -- atomic writes ---------------------------------------------------------------------------


def _atomic_write(path: Path, write_contents: Callable[[BinaryIO], None]) -> None:
    """``speedtronic.state.atomic_io.atomic_write`` with this module's temp names and errors.
    Temp names are hidden, carry the writer's PID (``.step_...pt.tmp-4242``, or
    ``.tmp-4242-<random>`` when that name is taken) and never end in ".pt": they can never
    match a checkpoint name, and stale ones are recognised by their dead writer."""
    try:
        atomic_write(path, write_contents, tag=str(os.getpid()))
    except Exception as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise _write_error(path, exc) from exc


_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def _write_error(path: Path, exc: Exception) -> CheckpointError:
    """The error of a failed write; a full disk (or quota) says so plainly, with the path
    and what is left, wherever in the chain torch or the OS reported it."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _DISK_FULL:
            return CheckpointError(
                f"no space left on device: could not write {path} ({_free_space(path.parent)} "
                "free there); free some space or point checkpoint.directory elsewhere, then "
                "resume (--resume) from the last checkpoint, which is intact"
            )
        seen = seen.__cause__ or seen.__context__
    return CheckpointError(f"could not write {path}: {type(exc).__name__}: {exc}")


def _free_space(directory: Path) -> str:
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return "unknown space"
    return f"{free / 2**20:.1f} MiB"


def atomic_torch_save(state: object, path: PathLike) -> str:
    """``torch.save`` to ``path`` atomically and durably (a reader sees the old file or the
    complete new one, also after a power loss). Returns the file's checksum: the SHA-256 of
    its record index (``archive_checksum``), which commits to every record's CRC-32."""
    checksum = ""

    def write(handle: BinaryIO) -> None:
        nonlocal checksum
        with _crc32_records():
            torch.save(state, handle)
        handle.flush()
        checksum = archive_checksum(handle)  # the bytes just written, not a name's

    _atomic_write(Path(path), write)
    return checksum


@contextlib.contextmanager
def _crc32_records() -> Iterator[None]:
    """Make ``torch.save`` store the CRC-32 of every record (its default; a user may have
    switched it off globally, and the integrity check depends on it)."""
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(True)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(previous)


def archive_checksum(path: PathLike | BinaryIO) -> str:
    """SHA-256 (hex) of a checkpoint archive's record index: each record's name, offset,
    sizes and CRC-32. Reads only the zip's central directory, not the data; together with
    the per-record CRC-32s it detects any change to the stored data. ``path`` may be an
    open binary file (readable and seekable). ``zipfile.BadZipFile`` when it is not a zip
    archive."""
    with zipfile.ZipFile(path) as archive:
        return _index_checksum(archive)


def _index_checksum(archive: zipfile.ZipFile) -> str:
    index = [
        [info.filename, info.header_offset, info.compress_size, info.file_size, info.CRC]
        for info in archive.infolist()
    ]
    return hashlib.sha256(json.dumps(index).encode("utf-8")).hexdigest()


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
        plain = _PlainWalk().plain(dict(state), "state")
    except _NotPlain as exc:
        raise CheckpointError(
            f"cannot checkpoint this state: {exc}; checkpoints may hold only tensors, numbers, "
            "strings, None and dicts/lists/tuples of those (they are loaded with "
            "torch.load(weights_only=True), which refuses pickled objects)"
        ) from None
    assert isinstance(plain, dict)
    return plain


MAX_STATE_DEPTH = 100
"""Deepest nesting of containers a checkpointed state may have (a model's state is ~5)."""


class _PlainWalk:
    """One ``plain_state`` pass: the containers on the path from the root (for cycles)."""

    def __init__(self) -> None:
        self.ancestors: dict[int, str] = {}

    def plain(self, value: object, where: str) -> object:
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
        if isinstance(value, dict | list | tuple | set):
            return self.container(value, where)
        raise _NotPlain(f"{where} is a {kind.__module__}.{kind.__qualname__}")

    def container(
        self,
        value: dict[object, object] | list[object] | tuple[object, ...] | set[object],
        where: str,
    ) -> object:
        key = id(value)
        if key in self.ancestors:
            raise _NotPlain(f"{where} refers back to {self.ancestors[key]} (a cycle)")
        if len(self.ancestors) >= MAX_STATE_DEPTH:
            raise _NotPlain(f"{where} is nested more than {MAX_STATE_DEPTH} containers deep")
        self.ancestors[key] = where
        try:
            return self.rebuild(value, where)
        finally:
            del self.ancestors[key]

    def rebuild(
        self,
        value: dict[object, object] | list[object] | tuple[object, ...] | set[object],
        where: str,
    ) -> object:
        if isinstance(value, dict):
            items = [
                (self.plain(k, f"{where} key {k!r}"), self.plain(v, f"{where}[{k!r}]"))
                for k, v in value.items()
            ]
            return OrderedDict(items) if isinstance(value, OrderedDict) else dict(items)
        parts = [self.plain(item, f"{where}[{index}]") for index, item in enumerate(value)]
        if isinstance(value, list):
            return parts
        return tuple(parts) if isinstance(value, tuple) else set(parts)


# -- loading -------------------------------------------------------------------------------


def load_checkpoint_file(path: PathLike, *, checksum: str | None = None) -> dict[str, object]:
    """Load one checkpoint with ``weights_only=True`` onto the CPU, after checking its
    integrity: every record against its CRC-32 and, when given, the record index against
    ``checksum`` (what ``atomic_torch_save`` returned).

    Raises ``UnsafeCheckpointError`` when it holds pickled objects, ``CorruptCheckpointError``
    when it is truncated, damaged or fails a check, ``CheckpointError`` when it is missing,
    cannot be read at all or is not a dict.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a file")
    _check_readable(path)
    _verify_archive(path, checksum)
    state = restricted_load(path, name=str(path))
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


_VERIFY_CHUNK = 16 * 1024 * 1024


def _verify_archive(path: Path, checksum: str | None) -> None:
    """``CorruptCheckpointError`` when the archive's index differs from ``checksum`` or a
    record's bytes fail their CRC-32. A file that is not a zip archive at all is left to
    ``torch.load`` when no checksum was recorded (an older or foreign format)."""
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile as exc:
        if checksum is None:
            return
        raise CorruptCheckpointError(
            f"checkpoint {path} is unreadable (not an intact zip archive although a checksum "
            f"was recorded for it: {first_line(exc)})"
        ) from exc
    except Exception as exc:  # OSError/ValueError/... from a damaged directory record
        raise CorruptCheckpointError(
            f"checkpoint {path} is unreadable (damaged zip directory): "
            f"{type(exc).__name__}: {first_line(exc)}"
        ) from exc
    with archive:
        actual = _index_checksum(archive)
        if checksum is not None and actual != checksum:
            raise CorruptCheckpointError(
                f"checkpoint {path} is unreadable (checksum mismatch: the pointer recorded "
                f"{checksum[:16]}..., the file has {actual[:16]}...; it was changed or "
                "replaced after it was saved)"
            )
        with (
            open(path, "rb") as handle,
            mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped,
        ):
            view = memoryview(mapped)
            try:
                for info in archive.infolist():
                    problem = _record_problem(archive, view, info)
                    if problem is not None:
                        raise CorruptCheckpointError(
                            f"checkpoint {path} is unreadable (record {info.filename} fails "
                            f"its integrity check: {problem})"
                        )
            finally:
                view.release()


_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra length
_LOCAL_SIGNATURE = b"PK\x03\x04"


def _record_problem(
    archive: zipfile.ZipFile, view: memoryview, info: zipfile.ZipInfo
) -> str | None:
    """Why a record's bytes do not match its CRC-32, or ``None``. Stored records (all that
    ``torch.save`` writes) are checked in place through the memory map, without copying;
    anything else through ``zipfile``."""
    if info.compress_type != zipfile.ZIP_STORED:
        try:
            with archive.open(info) as record:
                while record.read(_VERIFY_CHUNK):
                    pass
        except Exception as exc:  # BadZipFile "Bad CRC-32", EOFError, zlib.error, ...
            return f"{type(exc).__name__}: {first_line(exc)}"
        return None
    header_end = info.header_offset + _LOCAL_HEADER.size
    if header_end > len(view):
        return "its header lies beyond the end of the file"
    signature, name_length, extra_length = _LOCAL_HEADER.unpack(
        view[info.header_offset : header_end]
    )
    if signature != _LOCAL_SIGNATURE:
        return "no local header where the directory says"
    start = header_end + name_length + extra_length
    end = start + info.compress_size
    if end > len(view):
        return "the file is cut short"
    if zlib.crc32(view[start:end]) != info.CRC:
        return "Bad CRC-32 (its bytes changed after it was saved)"
    return None


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


# -- the pointer ------------------------------------------------------------------------------

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Pointer:
    """``latest.json`` after validation: the checkpoint it names (``None`` when it names
    none that is usable) and its per-file records (``{"sha256": ...}``) by file name."""

    target: Path | None
    records: dict[str, dict[str, object]]


MAX_POINTER_BYTES = 16 * 1024 * 1024
"""A larger ``latest.json`` is not one this module wrote (a record is ~150 bytes)."""


def parse_pointer(
    data: bytes, validate: Callable[[object], tuple[Pointer, str | None]]
) -> tuple[Pointer, str | None]:
    """Decode ``latest.json`` bytes and ``validate`` them: ``(pointer, None)``, or an empty
    ``Pointer`` and the problem. Never raises for any input (bounded: size-capped, and JSON
    nested too deeply is a problem, not a ``RecursionError``)."""
    empty = Pointer(None, {})
    if len(data) > MAX_POINTER_BYTES:
        return empty, f"it is {len(data)} bytes, more than a pointer can be"
    try:
        content = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return empty, f"it is not readable JSON ({first_line(exc)})"
    except RecursionError:
        return empty, "it is not readable JSON (nested too deeply)"
    return validate(content)


def _validate_records(value: object) -> tuple[dict[str, dict[str, object]], str | None]:
    """The pointer's ``checkpoints`` table: ``{file name: {"sha256": 64 hex digits}}``."""
    if not isinstance(value, dict):
        return {}, '"checkpoints" must be an object mapping file names to records'
    records: dict[str, dict[str, object]] = {}
    for name, record in value.items():
        if checkpoint_step(name) is None or not isinstance(record, dict):
            return {}, f'"checkpoints" has an invalid entry {name[:80]!r}'
        checksum = record.get("sha256")
        if checksum is not None and not (
            isinstance(checksum, str) and _SHA256_HEX.fullmatch(checksum)
        ):
            return {}, f'"checkpoints" records an invalid sha256 for {name!r}'
        records[name] = record
    return records, None


def _loss_record(loss: float | None) -> dict[str, object]:
    """The pointer's record of a checkpoint's loss: ``{"loss": 2.3, "finite_loss": true}``,
    ``{"loss": "nan", "finite_loss": false}`` (JSON has no NaN), or nothing when unknown."""
    if loss is None:
        return {}
    if math.isfinite(loss):
        return {"loss": loss, "finite_loss": True}
    return {"loss": str(loss), "finite_loss": False}


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


def _recorded_checksum(records: Mapping[str, Mapping[str, object]], name: str) -> str | None:
    checksum = records.get(name, {}).get("sha256")
    return checksum if isinstance(checksum, str) else None


@dataclass(frozen=True)
class BestCheckpoint:
    """``best.json`` after validation: the best checkpoint by ``monitor`` in ``mode`` and
    its ``value``."""

    path: Path
    step: int
    monitor: str
    mode: str
    value: float


# -- the manager ------------------------------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    if os.name != "posix":
        return True  # os.kill(pid, 0) would terminate the process on Windows: keep the file
    if not 0 < pid <= _MAX_PID:
        return False  # no process has it (a planted name; os.kill would overflow)
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
        if not 0 <= step <= MAX_STEP:
            raise ValueError(f"step must be in 0..{MAX_STEP}, got {step}")
        return self.directory / f"step_{step:0{STEP_DIGITS}d}.pt"

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
        records[path.name] = {"sha256": checksum, **_loss_record(noted if loss is None else loss)}
        best = self._noted_best.pop(step, None)
        best_path = path if best is not None else self.best_path(warn=False)
        # The records of what retention is about to delete are left out: the pointer never
        # records a file that is gone (it is written first, then the files are deleted).
        for retired in self._retired(path, records, best_path):
            records.pop(retired.name, None)
        self._write_pointer(path, records)
        if best is not None:
            monitor, mode, value = best
            content: dict[str, object] = {
                "step": step,
                "file": path.name,
                "checkpoints": {path.name: records[path.name]},
                "monitor": monitor,
                "mode": mode,
                "value": value,
            }
            atomic_json_dump(content, self.best_pointer_path)
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
            if name != exclude and _is_checkpoint_entry(self.directory / name)
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
        removed = self._remove_stale_temp_files()
        if self.keep_last is None:
            return removed
        pointer = self._read_pointer(warn=False)
        retired = self._retired(pointer.target, pointer.records, self.best_path(warn=False))
        names = {path.name for path in retired}
        if pointer.target is not None and names & set(pointer.records):
            kept = {n: r for n, r in pointer.records.items() if n not in names}
            self._write_pointer(pointer.target, kept)
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

    def _write_pointer(self, target: Path, records: Mapping[str, Mapping[str, object]]) -> None:
        """Make ``latest.json`` name ``target`` with ``records`` (atomically, durably)."""
        step = checkpoint_step(target.name)
        content = {"step": step, "file": target.name, "checkpoints": dict(records)}
        atomic_json_dump(content, self.pointer_path)

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
                _remove(entry)
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
        if source.is_dir():  # a sharded checkpoint: copied whole, then renamed into place
            try:
                copy_sharded(source, target)
            except OSError as exc:
                raise _write_error(target, exc) from exc
            return target

        def copy(handle: BinaryIO) -> None:
            with open(source, "rb") as src:
                shutil.copyfileobj(src, handle, length=16 * 1024 * 1024)

        _atomic_write(target, copy)
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
            if step is not None and _is_checkpoint_entry(entry) and self._inside(entry):
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
        return self._read_pointer(warn=warn).target

    def _read_pointer(self, *, warn: bool) -> Pointer:
        """``latest.json``, validated; an empty ``Pointer`` (with a warning when ``warn``)
        when it is absent, malformed, tampered or dangling."""
        pointer = self.pointer_path
        if not pointer.is_file():
            return Pointer(None, {})
        try:
            parsed, problem = parse_pointer(pointer.read_bytes(), self._validate_pointer)
        except OSError as exc:
            parsed, problem = Pointer(None, {}), f"it cannot be read ({first_line(exc)})"
        if problem is not None and warn:
            warnings.warn(
                f"ignoring checkpoint pointer {pointer}: {problem}; "
                f"looking for checkpoints in {self.directory} instead",
                UserWarning,
                stacklevel=4,
            )
        return parsed

    def read_best(self, *, warn: bool = True) -> BestCheckpoint | None:
        """``best.json``, validated like ``latest.json`` (a file name inside the directory
        that exists, a matching step) plus its ``monitor``, ``mode`` and finite ``value``;
        ``None`` (with a warning when ``warn``) when it is absent or not valid."""
        pointer = self.best_pointer_path
        if not pointer.is_file():
            return None
        best: list[BestCheckpoint] = []

        def validate(content: object) -> tuple[Pointer, str | None]:
            parsed, problem = self._validate_pointer(content)
            if problem is not None or parsed.target is None:
                return parsed, problem
            assert isinstance(content, dict)
            monitor, mode, value = content.get("monitor"), content.get("mode"), content.get("value")
            if not isinstance(monitor, str) or not monitor:
                return parsed, '"monitor" must be a non-empty string'
            if mode not in ("min", "max"):
                return parsed, '"mode" must be "min" or "max"'
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
            ):
                return parsed, '"value" must be a finite number'
            step = checkpoint_step(parsed.target.name)
            assert step is not None
            best.append(BestCheckpoint(parsed.target, step, monitor, str(mode), float(value)))
            return parsed, None

        try:
            _, problem = parse_pointer(pointer.read_bytes(), validate)
        except OSError as exc:
            problem = f"it cannot be read ({first_line(exc)})"
        if problem is not None:
            if warn:
                warnings.warn(
                    f"ignoring best-checkpoint pointer {pointer}: {problem}",
                    UserWarning,
                    stacklevel=2,
                )
            return None
        return best[0] if best else None

    def best_path(self, *, warn: bool = True) -> Path | None:
        """The checkpoint ``best.json`` names (validated), or ``None``."""
        best = self.read_best(warn=warn)
        return best.path if best is not None else None

    def _validate_pointer(self, content: object) -> tuple[Pointer, str | None]:
        if not isinstance(content, dict):
            return Pointer(None, {}), 'it must be a JSON object with a string "file"'
        records, problem = _validate_records(content.get("checkpoints", {}))
        if problem is not None:
            return Pointer(None, {}), problem
        target, problem = self._validate_target(content)
        return Pointer(target, records), problem

    def _validate_target(self, content: dict[str, object]) -> tuple[Path | None, str | None]:
        if not isinstance(content.get("file"), str):
            return None, 'it must be a JSON object with a string "file"'
        name = str(content["file"])
        step = checkpoint_step(name)
        if step is None:
            # Also rejects "../x.pt", "/abs/step_1.pt", "sub/step_1.pt": no separators allowed.
            return None, f"{name!r} is not a checkpoint file name (step_<digits>.pt) in it"
        if content.get("step") not in (None, step):
            return (
                None,
                f"its step {reprlib.repr(content.get('step'))} does not match file {name!r}",
            )
        target = self.directory / name
        if not self._inside(target):
            return None, f"{name!r} resolves outside the checkpoint directory"
        if not _is_checkpoint_entry(target):
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
        checksum = _recorded_checksum(records, path.name)
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
                checksum = _recorded_checksum(pointer.records, path.name)
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


def _is_checkpoint_entry(path: Path) -> bool:
    """A checkpoint file, or a sharded checkpoint's directory."""
    return path.is_dir() if path.suffix == SHARDED_SUFFIX else path.is_file()


def _remove(path: Path) -> None:
    """Delete a checkpoint file or a sharded checkpoint's directory (or a temp of either)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


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
    not failed (1), so it can be requeued and resumed with ``--resume``. A fit that spent
    its time budget (``speedtronic.state.time_budget``) exits ``TIME_BUDGET_EXIT_CODE`` (75).
    """
    if is_time_budget_stop(stop_reason):
        return TIME_BUDGET_EXIT_CODE
    if not stop_reason or not stop_reason.startswith(_SIGNAL_REASON_PREFIX):
        return None
    name = stop_reason.removeprefix(_SIGNAL_REASON_PREFIX).strip()
    try:
        return 128 + int(signal.Signals[name])
    except KeyError:
        return None
