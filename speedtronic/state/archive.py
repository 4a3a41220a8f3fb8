"""A checkpoint file: a ``torch.save`` zip archive, its checksum, and its verified load.

Integrity: ``torch.save`` writes a zip archive that stores a CRC-32 of every record; a save
(``atomic_torch_save``) records the SHA-256 of that record index (names, offsets, sizes,
CRC-32s) -- the checksum the pointer keeps for the file -- and a load
(``load_checkpoint_file``) checks the index against it and every record's bytes against
their CRC-32 before ``torch.load``. A mismatch is damage (``CorruptCheckpointError``: the
manager falls back to an older checkpoint). This costs no second pass over the data at save
time (the CRC-32s are taken as torch writes the bytes: ``speedtronic.state.record_crc``),
and the check at load time runs on the bytes ``torch.load`` reads
(``speedtronic.state.record_check``): the data is read once.

The load itself goes through ``speedtronic.state.safe_load.restricted_load``, the one
unpickling path of the storage layer: a file that holds pickled Python objects is refused
(``UnsafeCheckpointError``) instead of executing them.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, cast

import torch

from speedtronic.state.errors import CheckpointError, CorruptCheckpointError, first_line
from speedtronic.state.layout import PathLike, write_atomically
from speedtronic.state.record_check import (
    CheckingReader,
    StoredRecord,
    crc32,
    fast_crc32,
    locate_records,
)
from speedtronic.state.record_crc import CrcWriter, store_crcs
from speedtronic.state.safe_load import restricted_load

__all__ = ["archive_checksum", "atomic_torch_save", "load_checkpoint_file"]


def atomic_torch_save(state: object, path: PathLike) -> str:
    """``torch.save`` to ``path`` atomically and durably (a reader sees the old file or the
    complete new one, also after a power loss). Returns the file's checksum: the SHA-256 of
    its record index (``archive_checksum``), which commits to every record's CRC-32."""
    checksum = ""

    def write(handle: BinaryIO) -> None:
        nonlocal checksum
        _save_with_crcs(state, handle)
        handle.flush()
        checksum = archive_checksum(handle)  # the bytes just written, not a name's

    write_atomically(Path(path), write)
    return checksum


def _save_with_crcs(state: object, handle: BinaryIO) -> None:
    """``torch.save`` into the empty ``handle`` with the CRC-32 of every record stored:
    computed by ISA-L as the bytes are written (``record_crc``) where it is installed, else
    by torch; and by torch as well for an archive laid out in a way ``record_crc`` does not
    know (written again)."""
    if fast_crc32():
        writer = CrcWriter(handle)
        with _crc32_records(False, writer):
            torch.save(state, cast(BinaryIO, writer))
        handle.flush()
        if store_crcs(handle, writer.crcs):
            return
        handle.seek(0)
        handle.truncate()
    with _crc32_records(True):
        torch.save(state, handle)


_CRC32_SWITCH = threading.Lock()
"""Held while a save has torch's (process-wide) CRC-32 switch set: two saves on different
threads must not set back each other's value."""


@contextlib.contextmanager
def _crc32_records(enabled: bool, writer: CrcWriter | None = None) -> Iterator[None]:
    """Make ``torch.save`` store the CRC-32 of every record (``enabled``, its default; a
    user may have switched it off globally, and the integrity check depends on it), or
    leave them to ``record_crc``. With ``writer``, the switch is set back as torch writes
    its first byte there: torch reads it once, as it opens the archive, and a ``torch.save``
    on another thread sees it changed no longer than it takes torch to pickle the state's
    structure (the tensors' bytes are written after that)."""
    _CRC32_SWITCH.acquire()
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(enabled)
    restored = False

    def restore() -> None:
        nonlocal restored
        if not restored:
            restored = True
            torch.serialization.set_crc32_options(previous)
            _CRC32_SWITCH.release()

    if writer is not None:
        writer.on_first_write = restore
    try:
        yield
    finally:
        restore()


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


# -- loading -------------------------------------------------------------------------------


def load_checkpoint_file(path: PathLike, *, checksum: str | None = None) -> dict[str, object]:
    """Load one checkpoint with ``weights_only=True`` onto the CPU, after checking its
    integrity: every record against its CRC-32 and, when given, the record index against
    ``checksum`` (what ``atomic_torch_save`` returned).

    The index and the small records (the pickle among them) are checked before anything is
    unpickled; the tensor records as ``torch.load`` reads them (``record_check``), so the
    data is read once. Raises ``UnsafeCheckpointError`` when it holds pickled objects,
    ``CorruptCheckpointError`` when it is truncated, damaged or fails a check,
    ``CheckpointError`` when it is missing, cannot be read at all or is not a dict.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a file")
    try:
        handle = open(path, "rb", buffering=0)  # noqa: SIM115 -- closed below
        handle.read(1)
    except OSError as exc:
        # Permissions or an I/O error: an environment problem, not a damaged checkpoint
        # to step over.
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    with handle:
        tensors = _verify_archive(path, handle, checksum)
        if tensors is None:  # not a zip archive, and no checksum recorded: torch decides
            state = restricted_load(path, name=str(path))
        else:
            state = _load_checked(path, handle, tensors)
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{path} is not a speedtronic checkpoint: it holds a {type(state).__name__}, "
            "expected a dict"
        )
    return state


def _load_checked(path: Path, handle: io.FileIO, tensors: list[StoredRecord]) -> object:
    """``restricted_load`` of the open archive, checking the ``tensors`` records' CRC-32s
    as torch reads them, and afterwards any it did not read in one piece."""
    reader = CheckingReader(handle, tensors)
    try:
        state = restricted_load(cast(BinaryIO, reader), name=str(path))
    except CheckpointError as exc:
        if reader.failed:  # damage found on the way explains the failure
            raise _bad_record(path, reader.failed[0]) from exc
        raise
    for record in reader.unchecked:
        if _crc_of(handle, record) != record.crc:
            reader.failed.append(record.name)
    if reader.failed:
        raise _bad_record(path, reader.failed[0])
    return state


def _bad_record(path: Path, name: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"checkpoint {path} is unreadable (record {name} fails its integrity check: "
        "Bad CRC-32 (its bytes changed after it was saved))"
    )


_VERIFY_CHUNK = 16 * 1024 * 1024
_TENSOR_RECORD = re.compile(r"[^/]+/data/\d+")
"""The name of a tensor storage record in a ``torch.save`` archive (``<archive>/data/<key>``)."""


def _crc_of(handle: io.FileIO, record: StoredRecord) -> int:
    crc = 0
    handle.seek(record.start)
    left = record.size
    while left > 0:
        chunk = handle.read(min(left, _VERIFY_CHUNK))
        if not chunk:
            break  # cut short: the CRC cannot match
        crc = crc32(chunk, crc)
        left -= len(chunk)
    return crc


def _verify_archive(
    path: Path, handle: io.FileIO, checksum: str | None
) -> list[StoredRecord] | None:
    """Check the archive's index against ``checksum`` and every record but the tensor
    storages against its CRC-32; return the tensor records, for ``torch.load`` to check as
    it reads them. ``CorruptCheckpointError`` on a mismatch. ``None`` for a file that is not
    a zip archive at all when no checksum was recorded (an older or foreign format: left to
    ``torch.load``)."""
    try:
        archive = zipfile.ZipFile(handle)
    except zipfile.BadZipFile as exc:
        if checksum is None:
            return None
        raise CorruptCheckpointError(
            f"checkpoint {path} is unreadable (not an intact zip archive although a checksum "
            f"was recorded for it: {first_line(exc)})"
        ) from exc
    except Exception as exc:  # OSError/ValueError/... from a damaged directory record
        raise CorruptCheckpointError(
            f"checkpoint {path} is unreadable (damaged zip directory): "
            f"{type(exc).__name__}: {first_line(exc)}"
        ) from exc
    actual = _index_checksum(archive)
    if checksum is not None and actual != checksum:
        raise CorruptCheckpointError(
            f"checkpoint {path} is unreadable (checksum mismatch: the pointer recorded "
            f"{checksum[:16]}..., the file has {actual[:16]}...; it was changed or "
            "replaced after it was saved)"
        )
    infos = archive.infolist()
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED:  # torch.save stores; others: zipfile
            problem = _compressed_problem(archive, info)
            if problem is not None:
                raise _failed(path, info.filename, problem)
    stored = [info for info in infos if info.compress_type == zipfile.ZIP_STORED]
    located, broken = locate_records(
        cast(BinaryIO, handle), stored, os.fstat(handle.fileno()).st_size
    )
    if broken:
        raise _failed(path, broken[0][0].filename, broken[0][1])
    tensors = []
    for record in located:
        if _TENSOR_RECORD.fullmatch(record.name):
            tensors.append(record)
        elif _crc_of(handle, record) != record.crc:
            raise _bad_record(path, record.name)
    return tensors


def _failed(path: Path, name: str, problem: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"checkpoint {path} is unreadable (record {name} fails its integrity check: {problem})"
    )


def _compressed_problem(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> str | None:
    """Why a compressed record does not read back intact (``zipfile`` checks its CRC-32)."""
    try:
        with archive.open(info) as record:
            while record.read(_VERIFY_CHUNK):
                pass
    except Exception as exc:  # BadZipFile "Bad CRC-32", EOFError, zlib.error, ...
        return f"{type(exc).__name__}: {first_line(exc)}"
    return None
