"""A checkpoint file: a ``torch.save`` zip archive, its checksum, and its verified load.

Integrity: ``torch.save`` writes a zip archive that stores a CRC-32 of every record; a save
(``atomic_torch_save``) records the SHA-256 of that record index (names, offsets, sizes,
CRC-32s) -- the checksum the pointer keeps for the file -- and a load
(``load_checkpoint_file``) checks the index against it and every record's bytes against
their CRC-32 before ``torch.load``. A mismatch is damage (``CorruptCheckpointError``: the
manager falls back to an older checkpoint). This costs no second pass over the data at save
time, and the check at load time reads the records in place through a memory map.

The load itself goes through ``speedtronic.state.safe_load.restricted_load``, the one
unpickling path of the storage layer: a file that holds pickled Python objects is refused
(``UnsafeCheckpointError``) instead of executing them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import struct
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import torch

from speedtronic.state.errors import CheckpointError, CorruptCheckpointError, first_line
from speedtronic.state.layout import PathLike, write_atomically
from speedtronic.state.safe_load import restricted_load

__all__ = ["archive_checksum", "atomic_torch_save", "load_checkpoint_file"]


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

    write_atomically(Path(path), write)
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
