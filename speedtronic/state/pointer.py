"""The pointer files of a checkpoint directory: ``latest.json`` and ``best.json``.

``latest.json`` is the commit record: it names the newest *complete* checkpoint of its
directory and nothing outside it, and keeps per file the record of every checkpoint still
kept -- its checksum (``{"sha256": ...}``, what a load verifies the file against) and the
training loss at its step (``{"loss": 2.3, "finite_loss": true}``)::

    {"step": 4, "file": "step_000000000004.pt",
     "checkpoints": {"step_000000000002.pt": {"sha256": ...}, "step_000000000004.pt": {...}}}

``best.json`` has the same format for the best checkpoint by a monitored metric, plus its
``"monitor"``, ``"mode"`` (``min``/``max``) and finite ``"value"``.

A pointer is untrusted input: ``parse_pointer`` does bounded work on any bytes and answers
with a problem, never an exception, and a pointer that names a file outside its directory
(``../x.pt``, a symlink leading out), a missing one, or a step that does not match its file
is ignored with a warning (the manager then scans the directory instead). Both files are
written atomically (``atomic_json_dump``), after the checkpoint they name is on disk.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from speedtronic.state.errors import first_line
from speedtronic.state.layout import (
    BEST_POINTER_NAME,
    POINTER_NAME,
    PathLike,
    checkpoint_step,
    is_checkpoint_entry,
    is_inside,
    write_atomically,
)

__all__ = [
    "MAX_POINTER_BYTES",
    "BestCheckpoint",
    "Pointer",
    "atomic_json_dump",
    "loss_record",
    "parse_pointer",
    "read_best",
    "read_pointer",
    "recorded_checksum",
    "validate_pointer",
    "write_best",
    "write_pointer",
]

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")

Records = Mapping[str, Mapping[str, object]]
"""A pointer's ``checkpoints`` table: file name -> its record."""


@dataclass(frozen=True)
class Pointer:
    """``latest.json`` after validation: the checkpoint it names (``None`` when it names
    none that is usable) and its per-file records (``{"sha256": ...}``) by file name."""

    target: Path | None
    records: dict[str, dict[str, object]]


@dataclass(frozen=True)
class BestCheckpoint:
    """``best.json`` after validation: the best checkpoint by ``monitor`` in ``mode`` and
    its ``value``."""

    path: Path
    step: int
    monitor: str
    mode: str
    value: float


MAX_POINTER_BYTES = 16 * 1024 * 1024
"""A larger ``latest.json`` is not one this module wrote (a record is ~150 bytes)."""


def parse_pointer(
    data: bytes, validate: Callable[[object], tuple[Pointer, str | None]]
) -> tuple[Pointer, str | None]:
    """Decode ``latest.json`` bytes and ``validate`` them: ``(pointer, None)``, or an empty
    ``Pointer`` and the problem. Never raises for any input (bounded: size-capped, and JSON
    nested too deeply is a problem, not a ``RecursionError``)."""
    content, problem = decode_pointer_bytes(data)
    if problem is not None:
        return Pointer(None, {}), problem
    return validate(content)


def decode_pointer_bytes(data: bytes) -> tuple[object, str | None]:
    """The JSON value of pointer bytes, ``(value, None)``, or ``(None, problem)``: size-capped,
    and JSON nested too deeply is a problem, not a ``RecursionError`` (local and remote
    pointers alike)."""
    if len(data) > MAX_POINTER_BYTES:
        return None, f"it is {len(data)} bytes, more than a pointer can be"
    try:
        return json.loads(data.decode("utf-8")), None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"it is not readable JSON ({first_line(exc)})"
    except RecursionError:
        return None, "it is not readable JSON (nested too deeply)"


def validate_pointer(directory: Path, content: object) -> tuple[Pointer, str | None]:
    """Decoded pointer ``content`` of ``directory`` as a ``Pointer`` and ``None``, or an
    empty one and the problem: its records well-formed, its file a checkpoint name that
    exists inside the directory, its step that file's."""
    if not isinstance(content, dict):
        return Pointer(None, {}), 'it must be a JSON object with a string "file"'
    records, problem = _validate_records(content.get("checkpoints", {}))
    if problem is not None:
        return Pointer(None, {}), problem
    target, problem = _validate_target(directory, content)
    return Pointer(target, records), problem


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


def _validate_target(directory: Path, content: dict[str, object]) -> tuple[Path | None, str | None]:
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
    target = directory / name
    if not is_inside(target, directory):
        return None, f"{name!r} resolves outside the checkpoint directory"
    if not is_checkpoint_entry(target):
        return None, f"it names {name!r}, which does not exist"
    return target, None


def read_pointer(directory: Path, *, warn: bool) -> Pointer:
    """``directory``'s ``latest.json``, validated; an empty ``Pointer`` (with a warning when
    ``warn``) when it is absent, malformed, tampered or dangling."""
    pointer = directory / POINTER_NAME
    if not pointer.is_file():
        return Pointer(None, {})
    try:
        parsed, problem = parse_pointer(
            pointer.read_bytes(), lambda content: validate_pointer(directory, content)
        )
    except OSError as exc:
        parsed, problem = Pointer(None, {}), f"it cannot be read ({first_line(exc)})"
    if problem is not None and warn:
        warnings.warn(
            f"ignoring checkpoint pointer {pointer}: {problem}; "
            f"looking for checkpoints in {directory} instead",
            UserWarning,
            stacklevel=5,  # past the manager's method: at the caller of its public one
        )
    return parsed


def read_best(directory: Path, *, warn: bool) -> BestCheckpoint | None:
    """``directory``'s ``best.json``, validated like ``latest.json`` (a file name inside the
    directory that exists, a matching step) plus its ``monitor``, ``mode`` and finite
    ``value``; ``None`` (with a warning when ``warn``) when it is absent or not valid."""
    pointer = directory / BEST_POINTER_NAME
    if not pointer.is_file():
        return None
    best: list[BestCheckpoint] = []

    def validate(content: object) -> tuple[Pointer, str | None]:
        parsed, problem = validate_pointer(directory, content)
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
                stacklevel=3,  # at the caller of the manager's read_best
            )
        return None
    return best[0] if best else None


def recorded_checksum(records: Records, name: str) -> str | None:
    """The checksum a pointer's records hold for file ``name``, or ``None``."""
    checksum = records.get(name, {}).get("sha256")
    return checksum if isinstance(checksum, str) else None


def loss_record(loss: float | None) -> dict[str, object]:
    """The pointer's record of a checkpoint's loss: ``{"loss": 2.3, "finite_loss": true}``,
    ``{"loss": "nan", "finite_loss": false}`` (JSON has no NaN), or nothing when unknown."""
    if loss is None:
        return {}
    if math.isfinite(loss):
        return {"loss": loss, "finite_loss": True}
    return {"loss": str(loss), "finite_loss": False}


# -- writing -------------------------------------------------------------------------------


def write_pointer(directory: Path, target: Path, records: Records) -> None:
    """Make ``directory``'s ``latest.json`` name ``target`` with ``records`` (atomically,
    durably)."""
    step = checkpoint_step(target.name)
    content = {"step": step, "file": target.name, "checkpoints": dict(records)}
    atomic_json_dump(content, directory / POINTER_NAME)


def write_best(
    directory: Path,
    target: Path,
    record: Mapping[str, object],
    best: tuple[str, str, float],
) -> None:
    """Make ``directory``'s ``best.json`` name ``target`` (its pointer record ``record``)
    as the best by ``best``: ``(monitor, mode, value)``."""
    monitor, mode, value = best
    content: dict[str, object] = {
        "step": checkpoint_step(target.name),
        "file": target.name,
        "checkpoints": {target.name: record},
        "monitor": monitor,
        "mode": mode,
        "value": value,
    }
    atomic_json_dump(content, directory / BEST_POINTER_NAME)


def atomic_json_dump(value: object, path: PathLike) -> None:
    """Write ``value`` as indented JSON to ``path``, atomically and durably."""
    data = (json.dumps(value, indent=2, sort_keys=True) + "\n").encode("utf-8")

    def write(handle: BinaryIO) -> None:
        handle.write(data)

    write_atomically(Path(path), write)
